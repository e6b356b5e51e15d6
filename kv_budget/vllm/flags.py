"""The ``--model-local-kv-*`` flags on every parser built from EngineArgs.

vLLM builds the ``vllm serve`` and ``python -m vllm.entrypoints.openai.api_server``
parsers through ``EngineArgs.add_cli_args`` (after loading general plugins),
then turns the namespace into EngineArgs with ``EngineArgs.from_cli_args``,
which drops attributes that are not EngineArgs fields. So two patches: one
adds the flags, one copies their values into
``additional_config["model_local_kv"]``, which reaches every process.
Flags given explicitly win over the same keys in ``--additional-config``;
other keys there are kept. ``--model-local-kv-override`` (repeatable) adds to
the ``overrides`` list given there rather than replacing it: both are
corrections the operator asked for, and dropping one would be silent.

The two signatures are checked by ``compat.check_vllm`` before patching.
"""

from __future__ import annotations

import argparse

from kv_budget.plan.planner import Policy
from kv_budget.settings import CONFIG_KEY, DEFAULT_POLICY
from kv_budget.units import byte_size_argument
from kv_budget.vllm.patching import patch_method
from kv_budget.watch.live import DEFAULT_SAMPLE_INTERVAL_S

_FLAG_TO_KEY = {
    "model_local_kv_policy": "policy",
    "model_local_kv_headroom": "headroom_bytes",
    "model_local_kv_margin": "margin_bytes",
    "model_local_kv_report": "report_path",
    "model_local_kv_override": "overrides",
    "model_local_kv_ledger_dir": "ledger_dir",
    "model_local_kv_share": "share_bytes",
    "model_local_kv_sample_interval": "sample_interval_s",
}
"""argparse dest -> key in additional_config["model_local_kv"]."""



def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds >= 0 (0: no live sampling)")
    return value


def add_flags(parser):
    """Add the flag group once (vLLM may build the same parser twice)."""
    if any("--model-local-kv-policy" in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="ModelLocalKV",
        description="kv-budget: cap max_num_seqs so model-local KV (caches kept outside the paged "
        "KV pool) fits the device headroom left after startup.",
    )
    # default=SUPPRESS: the attribute is absent unless given, so an explicit
    # flag can be told from a key set through --additional-config.
    group.add_argument(
        "--model-local-kv-policy", choices=[p.value for p in Policy], default=argparse.SUPPRESS,
        help=f"cap: lower max_num_seqs to what fits, refuse to start if not one sequence fits; "
        f"reserve: keep max_num_seqs, take model-local KV out of the paged KV pool before it is allocated; "
        f"warn: log the plan, change nothing; off: do nothing. Default: {DEFAULT_POLICY.value}.",
    )
    group.add_argument(
        "--model-local-kv-headroom", type=byte_size_argument, default=argparse.SUPPRESS, metavar="SIZE",
        help="Headroom per worker for model-local KV (e.g. 14GiB, 512MiB, bytes), used as given. "
        "Default: measured after startup (NVML free memory; system/cgroup memory on CPU) minus the margin.",
    )
    group.add_argument(
        "--model-local-kv-margin", type=byte_size_argument, default=argparse.SUPPRESS, metavar="SIZE",
        help="Safety margin taken off a measured headroom. Default: 5%% of the device, at least 1GiB.",
    )
    group.add_argument(
        "--model-local-kv-report", default=argparse.SUPPRESS, metavar="PATH",
        help="Write the startup plan as JSON to PATH.",
    )
    group.add_argument(
        "--model-local-kv-ledger-dir", default=argparse.SUPPRESS, metavar="DIR",
        help="Directory of the device ledger engines sharing a device plan against (each records the "
        "model-local bytes it reserved; later ones plan against what is left). 'off' plans alone. "
        "Default: $KV_BUDGET_LEDGER_DIR, else $XDG_RUNTIME_DIR/kv-budget, else /tmp/kv-budget-UID.",
    )
    group.add_argument(
        "--model-local-kv-share", type=byte_size_argument, default=argparse.SUPPRESS, metavar="SIZE",
        help="This engine's share of the device headroom (e.g. 4GiB), leaving the rest to engines that "
        "start later on the same device. Default: whatever the engines already running left.",
    )
    group.add_argument(
        "--model-local-kv-sample-interval", type=_seconds, default=argparse.SUPPRESS, metavar="SECONDS",
        help="Seconds between live samples of the bytes model-local caches hold while serving (an "
        "under-declaration lowers the live limit under cap; leaks and absent caches are logged; figures on "
        f"/metrics). 0 turns live sampling off. Default: {DEFAULT_SAMPLE_INTERVAL_S:g}.",
    )
    group.add_argument(
        "--model-local-kv-override", action="append", default=argparse.SUPPRESS,
        metavar="OWNER/NAME:FIELD=VALUE",
        help="Correct one field of one declaration before planning, e.g. "
        "decoder/codec_decoder_request:physical_capacity_positions=72. Repeatable; applied in order "
        "after any overrides in --additional-config. An override that matches no declaration is an error.",
    )
    return parser


def merge_flags_into_additional_config(engine_args, namespace) -> None:
    """Copy explicitly given flags into ``engine_args.additional_config``."""
    given = {key: getattr(namespace, dest) for dest, key in _FLAG_TO_KEY.items() if hasattr(namespace, dest)}
    if not given:
        return
    additional = engine_args.additional_config
    if not isinstance(additional, dict):
        raise ValueError(f"--model-local-kv-* flags need additional_config to be a dict, got {type(additional).__name__}")
    additional = dict(additional)  # never mutate the namespace's own dict
    section = dict(additional.get(CONFIG_KEY) or {})
    if "overrides" in given:
        earlier = section.get("overrides") or []
        if not isinstance(earlier, (list, tuple)):
            raise ValueError(
                f"additional_config[{CONFIG_KEY!r}]['overrides'] must be a list to add "
                f"--model-local-kv-override to, got {earlier!r}"
            )
        given["overrides"] = list(earlier) + list(given["overrides"])
    section.update(given)
    additional[CONFIG_KEY] = section
    engine_args.additional_config = additional


def patch_engine_args(engine_args_cls) -> None:
    """Wrap the staticmethod ``add_cli_args`` and the classmethod ``from_cli_args``."""

    def wrap_add_cli_args(original):
        def add_cli_args(parser):
            return add_flags(original(parser))
        return add_cli_args

    def wrap_from_cli_args(original):
        def from_cli_args(cls, args):
            engine_args = original(cls, args)
            merge_flags_into_additional_config(engine_args, args)
            return engine_args
        return from_cli_args

    patch_method(engine_args_cls, "add_cli_args", wrap_add_cli_args)
    patch_method(engine_args_cls, "from_cli_args", wrap_from_cli_args)
