"""The engine-side settings: ``additional_config["model_local_kv"]``.

vLLM carries ``VllmConfig.additional_config`` to every process, which makes
it the supported place for a plugin's settings; the command-line flags
``--model-local-kv-*`` are written into it, so ``LLM(additional_config=...)``
and ``vllm serve --model-local-kv-policy ...`` behave the same. Values must
stay JSON types: vLLM hashes the dict into its compile-cache key.

Unknown keys and bad values raise ``ValueError`` naming the key: a misspelt
``"polcy": "warn"`` silently ignored would leave the default ``cap`` in force.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from kv_budget.override import OverrideError, parse_overrides
from kv_budget.plan.planner import Policy
from kv_budget.units import parse_byte_size
from kv_budget.watch.live import DEFAULT_SAMPLE_INTERVAL_S

__all__ = ["CONFIG_KEY", "DEFAULT_POLICY", "LEDGER_OFF", "ModelLocalKVSettings", "settings_from_additional_config"]

CONFIG_KEY = "model_local_kv"

LEDGER_OFF = "off"
"""``ledger_dir`` value that turns the shared device ledger off."""

DEFAULT_POLICY = Policy.CAP
"""Installing the plugin is the opt-in: a server that has it is protected
without further flags. ``warn`` or ``off`` are one flag away."""


class ModelLocalKVSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    policy: Policy = DEFAULT_POLICY
    headroom_bytes: int | None = None
    """Explicit headroom per worker, used as given (no margin taken off);
    None: measure the device after startup."""

    margin_bytes: int | None = None
    """Safety margin off a measured headroom; None: the default margin."""

    report_path: str | None = None
    """Where to write the startup plan as JSON; None: no file."""

    overrides: tuple[str, ...] = ()
    """Operator corrections ``OWNER/NAME:FIELD=VALUE`` (:mod:`kv_budget.override`),
    applied in order before planning. Kept as text: it crosses process
    boundaries inside ``additional_config``, which must stay JSON."""


    ledger_dir: str | None = None
    """The device ledger's directory (:mod:`kv_budget.ledger`); None: the
    default runtime directory; ``"off"``: plan alone, as if the device were
    this engine's only."""

    share_bytes: int | None = None
    """This engine's share of the device headroom, leaving the rest to
    engines that start later (stages of one deployment on one GPU); None:
    whatever the engines already running left."""

    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    """Seconds between live samples of model-local KV while serving
    (:mod:`kv_budget.watch.live`); 0 turns live sampling off."""


_KNOWN = (
    "policy", "headroom_bytes", "margin_bytes", "report_path", "overrides", "ledger_dir", "share_bytes",
    "sample_interval_s",
)


def _where(key: str) -> str:
    return f"additional_config[{CONFIG_KEY!r}][{key!r}]"


def settings_from_additional_config(additional_config: Any) -> ModelLocalKVSettings:
    """Read and validate the plugin's settings; absent means the defaults."""
    if not isinstance(additional_config, dict):
        # vLLM also accepts a hashable object of another plugin's here; it
        # cannot carry our key, and refusing it would break that engine.
        return ModelLocalKVSettings()
    raw = additional_config.get(CONFIG_KEY)
    if raw is None:
        return ModelLocalKVSettings()
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {raw!r}")
    unknown = sorted(set(raw) - set(_KNOWN))
    if unknown:
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] has unknown key(s) {unknown}; known: {list(_KNOWN)}")
    values: dict[str, Any] = {}
    if raw.get("policy") is not None:
        try:
            values["policy"] = Policy(raw["policy"])
        except ValueError:
            raise ValueError(
                f"{_where('policy')} = {raw['policy']!r} is invalid: choose from {[p.value for p in Policy]}"
            ) from None
    for key in ("headroom_bytes", "margin_bytes", "share_bytes"):
        if raw.get(key) is not None:
            try:
                values[key] = parse_byte_size(raw[key])
            except ValueError as exc:
                raise ValueError(f"{_where(key)}: {exc}") from None
    if raw.get("report_path") is not None:
        if not isinstance(raw["report_path"], str) or not raw["report_path"]:
            raise ValueError(f"{_where('report_path')} = {raw['report_path']!r} is invalid: expected a file path")
        values["report_path"] = raw["report_path"]
    if raw.get("ledger_dir") is not None:
        if not isinstance(raw["ledger_dir"], str) or not raw["ledger_dir"]:
            raise ValueError(f"{_where('ledger_dir')} = {raw['ledger_dir']!r} is invalid: expected a directory or 'off'")
        values["ledger_dir"] = raw["ledger_dir"]
    if raw.get("sample_interval_s") is not None:
        interval = raw["sample_interval_s"]
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < float("inf"):
            raise ValueError(
                f"{_where('sample_interval_s')} = {interval!r} is invalid: expected seconds >= 0 (0: no live sampling)"
            )
        values["sample_interval_s"] = float(interval)
    if raw.get("overrides") is not None:
        texts = raw["overrides"]
        if not isinstance(texts, (list, tuple)):
            raise ValueError(
                f"{_where('overrides')} = {texts!r} is invalid: expected a list of OWNER/NAME:FIELD=VALUE strings"
            )
        try:
            parse_overrides(texts)
        except OverrideError as exc:
            raise ValueError(f"{_where('overrides')}: {exc}") from None
        values["overrides"] = tuple(texts)
    return ModelLocalKVSettings(**values)
