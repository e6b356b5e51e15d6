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

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict

from kv_budget.collect.supplied import SuppliedDeclarationsError, supplied_source
from kv_budget.override import OverrideError, parse_overrides
from kv_budget.units import byte_size_argument, parse_byte_size, seconds_argument

__all__ = [
    "CONFIG_KEY", "COST_RECORD_OFF", "DEFAULT_POLICY", "DEFAULT_SAMPLE_INTERVAL_S", "KNOWN_KEYS", "LEDGER_OFF", "SETTINGS",
    "ModelLocalKVSettings", "Policy", "Setting", "settings_from_additional_config",
]

CONFIG_KEY = "model_local_kv"


class Policy(str, Enum):
    """What the engine does with a plan that does not fit."""

    CAP = "cap"
    """Lower ``max_num_seqs`` to the safe value; refuse to start if not one
    sequence fits."""

    WARN = "warn"
    """Log the same figures and change nothing."""

    OFF = "off"
    """Change nothing. The engine hook returns before collecting or
    sampling anything (it only reads the settings, and warns about one
    that applies nowhere); the ``plan`` command reports as under ``warn``."""

    RESERVE = "reserve"
    """Keep ``max_num_seqs``; take model-local KV at that concurrency out of
    the paged pool before vLLM allocates it (:mod:`kv_budget.plan.reserve`).
    Refuse to start if the pool left cannot hold one ``max_model_len``
    sequence."""


DEFAULT_SAMPLE_INTERVAL_S = 1.0
"""Seconds between live samples, at least (the sampling is also held to
:data:`kv_budget.watch.live.MAX_SAMPLING_FRACTION` of the engine's time).
The first sample is taken at the first step, so a short declaration is
caught before the first requests have grown; later samples follow growth
and catch leaks."""

LEDGER_OFF = "off"
"""``ledger_dir`` value that turns the shared device ledger off."""

COST_RECORD_OFF = "off"
"""``cost_record_dir`` value that turns the cost record off."""

DEFAULT_POLICY = Policy.CAP
"""Installing the plugin is the opt-in: a server that has it is protected
without further flags. ``warn`` or ``off`` are one flag away."""


class ModelLocalKVSettings(BaseModel):
    """The settings of one engine; every field is one row of :data:`SETTINGS`."""

    model_config = ConfigDict(frozen=True)

    policy: Policy = DEFAULT_POLICY
    headroom_bytes: int | None = None
    """Explicit headroom per worker, used as given (no margin taken off);
    None: measure the device after startup."""

    margin_bytes: int | None = None
    """Safety margin off a measured headroom; None: the default margin."""

    report_path: str | None = None
    """Where to write the startup plan as JSON; None: no file."""

    ledger_dir: str | None = None
    """The device ledger's directory (:mod:`kv_budget.ledger`); None: the
    default runtime directory; ``"off"``: plan alone, as if the device were
    this engine's only."""

    ledger_shared: bool = False
    """Whether the ledger directory is an operator's for a group, so engines
    of several users on one device plan against one ledger
    (:mod:`kv_budget.runtime_files`); off: private to this user."""

    share_bytes: int | None = None
    """This engine's share of the device headroom, leaving the rest to
    engines that start later (stages of one deployment on one GPU); None:
    whatever the engines already running left."""

    device_memory_bytes: int | None = None
    """In a vLLM-Omni deployment: the size of each device its stages use,
    where it cannot be measured (vLLM's CPU build has no device size); the
    driver splits the device between the stages from it. None: measured
    (NVML), or no split where nothing can be measured."""

    cost_record_dir: str | None = None
    """Where the live watch keeps what a held sequence cost this engine's
    device, for the first burst of its next start
    (:mod:`kv_budget.watch.cost_record`); None: the default runtime
    directory; ``"off"``: neither read nor written."""

    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    """Seconds between live samples of model-local KV while serving
    (:mod:`kv_budget.watch.live`); 0 turns live sampling off."""

    step_peaks: bool = True
    """Whether a sampled engine step also counts the caches that live only
    inside it (:mod:`kv_budget.sample.in_step`): per-step working copies and
    caches no declaration covers. Off: only caches kept between steps are
    measured, and an owner declaring only ``invocation`` caches is not
    observable."""

    overrides: tuple[str, ...] = ()
    """Operator corrections ``[STAGE:]OWNER/NAME:FIELD=VALUE`` (:mod:`kv_budget.override`),
    applied in order before planning. Kept as text: it crosses process
    boundaries inside ``additional_config``, which must stay JSON."""

    declarations: str | None = None
    """A preset name or a spec file whose declarations are planned beside
    the model's own (:mod:`kv_budget.collect.supplied`); None: the model's only."""


def _where(key: str) -> str:
    return f"additional_config[{CONFIG_KEY!r}][{key!r}]"


def _read_policy(key: str, value: Any) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise ValueError(f"{_where(key)} = {value!r} is invalid: choose from {[p.value for p in Policy]}") from None


def _read_bytes(key: str, value: Any) -> int:
    try:
        return parse_byte_size(value)
    except ValueError as exc:
        raise ValueError(f"{_where(key)}: {exc}") from None


def _text_reader(expected: str) -> Callable[[str, Any], str]:
    def read(key: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{_where(key)} = {value!r} is invalid: expected {expected}")
        return value
    return read


def _read_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{_where(key)} = {value!r} is invalid: expected seconds >= 0 (0: no live sampling)")
    return float(value)


def _read_switch(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("on", "off"):
        return value == "on"
    raise ValueError(f"{_where(key)} = {value!r} is invalid: expected 'on' or 'off' (or true/false)")


def _read_declarations(key: str, value: Any) -> str:
    text = _text_reader("a preset name or a spec file path")(key, value)
    try:
        supplied_source(text)
    except SuppliedDeclarationsError as exc:
        raise ValueError(f"{_where(key)}: {exc}") from None
    return text


def _read_overrides(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{_where(key)} = {value!r} is invalid: expected a list of [STAGE:]OWNER/NAME:FIELD=VALUE strings")
    try:
        parse_overrides(value)
    except OverrideError as exc:
        raise ValueError(f"{_where(key)}: {exc}") from None
    return tuple(value)


@dataclass(frozen=True)
class Setting:
    """One setting, the way an operator gives it: a key of
    ``additional_config["model_local_kv"]`` and the flag that writes it."""

    key: str
    """The field of :class:`ModelLocalKVSettings` and the ``additional_config`` key."""
    flag: str
    metavar: str | None
    """What the flag takes, as ``--help`` and the README show it; None: its choices."""
    help: str
    """The flag's ``--help`` text (argparse formatting: ``%%`` is a percent sign)."""
    read: Callable[[str, Any], Any]
    """Validate a value found in ``additional_config``; raises ValueError naming the key."""
    flag_type: Callable[[str], Any] | None = None
    """How the flag's text becomes the value (argparse ``type=``); None: the text."""
    choices: tuple[str, ...] = ()
    repeatable: bool = False
    """Given several times, the flag adds to a list instead of replacing it."""


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "policy", "--model-local-kv-policy", None,
        "cap: lower max_num_seqs to what fits, refuse to start if not one sequence fits; "
        "reserve: keep max_num_seqs, take model-local KV out of the paged KV pool before it is allocated; "
        f"warn: log the plan, change nothing; off: do nothing. Default: {DEFAULT_POLICY.value}.",
        _read_policy, choices=tuple(p.value for p in Policy),
    ),
    Setting(
        "headroom_bytes", "--model-local-kv-headroom", "SIZE",
        "Headroom per worker for model-local KV (e.g. 14GiB, 512MiB, bytes), used as given. "
        "Default: measured after startup (NVML free memory; system/cgroup memory on CPU) minus the margin.",
        _read_bytes, flag_type=byte_size_argument,
    ),
    Setting(
        "margin_bytes", "--model-local-kv-margin", "SIZE",
        "Safety margin taken off a measured headroom. Default: 5%% of the device, at least 1GiB.",
        _read_bytes, flag_type=byte_size_argument,
    ),
    Setting("report_path", "--model-local-kv-report", "PATH", "Write the startup plan as JSON to PATH.",
            _text_reader("a file path")),
    Setting(
        "ledger_dir", "--model-local-kv-ledger-dir", "DIR",
        "Directory of the device ledger engines sharing a device plan against (each records the "
        f"model-local bytes it reserved; later ones plan against what is left). '{LEDGER_OFF}' plans alone. "
        "Default: $KV_BUDGET_LEDGER_DIR, else $XDG_RUNTIME_DIR/kv-budget, else /tmp/kv-budget-UID.",
        _text_reader(f"a directory or '{LEDGER_OFF}'"),
    ),
    Setting(
        "ledger_shared", "--model-local-kv-ledger-shared", None,
        "on: the ledger directory is one an operator made for a group (set-group-ID, e.g. mode 2770, "
        "this user in its group), so engines of several users on one device plan against one ledger; "
        "off: the directory must be this user's alone. Default: off.",
        _read_switch, choices=("on", "off"),
    ),
    Setting(
        "share_bytes", "--model-local-kv-share", "SIZE",
        "This engine's share of the device headroom (e.g. 4GiB), leaving the rest to engines that "
        "start later on the same device. Default: whatever the engines already running left.",
        _read_bytes, flag_type=byte_size_argument,
    ),
    Setting(
        "device_memory_bytes", "--model-local-kv-device-memory", "SIZE",
        "vLLM-Omni only: the size of each device the deployment's stages share, where it cannot be measured "
        "(vLLM's CPU build); the stages on a device split what vLLM-Omni's admission terms leave of it. "
        "Default: measured by NVML on CUDA; elsewhere no split unless this or the headroom is given.",
        _read_bytes, flag_type=byte_size_argument,
    ),
    Setting(
        "cost_record_dir", "--model-local-kv-cost-record", "DIR",
        "Private directory where the live watch records what a held sequence cost the device, so the next start "
        "of the same engine admits its first burst at that cost. 'off': neither read nor written. "
        "Default: the ledger's default directory.",
        _text_reader("a directory or 'off'"),
    ),
    Setting(
        "sample_interval_s", "--model-local-kv-sample-interval", "SECONDS",
        "Seconds between live samples of the bytes model-local caches hold while serving (an "
        "under-declaration lowers the live limit under cap; leaks and absent caches are logged; figures on "
        f"/metrics). 0 turns live sampling off. Default: {DEFAULT_SAMPLE_INTERVAL_S:g}.",
        _read_seconds, flag_type=seconds_argument,
    ),
    Setting(
        "step_peaks", "--model-local-kv-step-peaks", None,
        "on: a sampled engine step also measures the transformers caches that live only inside it (per-step "
        "working copies, caches no declaration covers) at their peak; off: only caches kept between steps. "
        "Default: on.",
        _read_switch, choices=("on", "off"),
    ),
    Setting(
        "overrides", "--model-local-kv-override", "OWNER/NAME:FIELD=VALUE",
        "Correct one field of one declaration before planning, e.g. "
        "decoder/codec_decoder_request:physical_capacity_positions=72; in vLLM-Omni, STAGE: first applies it "
        "to that stage only (1:decoder/...). Repeatable; applied in order after any overrides in "
        "--additional-config. An override that matches no declaration (in any stage) is an error.",
        _read_overrides, repeatable=True,
    ),
    Setting(
        "declarations", "--model-local-kv-declarations", "PRESET_OR_SPEC_FILE",
        "Plan the declarations of a preset (kv-budget plan --list-presets) or a JSON spec file beside the "
        "model's own, marked operator-supplied: for a model that holds caches it does not declare.",
        _read_declarations,
    ),
)
"""Every setting, in the order ``--help`` and the README's table list them:
the flags (:mod:`vllm_patches.flags`), the accepted keys and their
validation come from this table, and a test holds the README's to it."""

KNOWN_KEYS = tuple(setting.key for setting in SETTINGS)


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
    unknown = sorted(set(raw) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] has unknown key(s) {unknown}; known: {list(KNOWN_KEYS)}")
    values = {
        setting.key: setting.read(setting.key, raw[setting.key])
        for setting in SETTINGS if raw.get(setting.key) is not None
    }
    return ModelLocalKVSettings(**values)
