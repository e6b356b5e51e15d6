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
from typing import Any

from kv_budget.settings import CONFIG_KEY, SETTINGS, Setting
from vllm_patches.patching import patch_method


def flag_dest(setting: Setting) -> str:
    """The flag's argparse destination (``model_local_kv_policy``), which is
    also the keyword vLLM-Omni's entry points receive it as."""
    return setting.flag.lstrip("-").replace("-", "_")


def merged_section(earlier: dict, given: dict) -> dict:
    """``earlier`` with ``given`` winning per key, except ``overrides``,
    which add up (``earlier``'s first): both are corrections the operator
    asked for, and dropping one would be silent."""
    section = dict(earlier)
    given = dict(given)
    if "overrides" in given and "overrides" in section:
        for value in (section["overrides"], given["overrides"]):
            if not isinstance(value, (list, tuple)):
                raise ValueError(
                    f"additional_config[{CONFIG_KEY!r}]['overrides'] must be a list to add more overrides to, "
                    f"got {value!r}"
                )
        given["overrides"] = list(section["overrides"]) + list(given["overrides"])
    section.update(given)
    return section


def add_flags(parser):
    """Add the flag group of :data:`~kv_budget.settings.SETTINGS` once
    (vLLM may build the same parser twice)."""
    if any(SETTINGS[0].flag in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group(
        title="ModelLocalKV",
        description="kv-budget: cap max_num_seqs so model-local KV (caches kept outside the paged "
        "KV pool) fits the device headroom left after startup.",
    )
    for setting in SETTINGS:
        # default=SUPPRESS: the attribute is absent unless given, so an
        # explicit flag can be told from a key set through --additional-config.
        options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": setting.help}
        if setting.choices:
            options["choices"] = list(setting.choices)
        else:
            options["metavar"] = setting.metavar
        if setting.repeatable:
            options["action"] = "append"
        if setting.flag_type is not None:
            options["type"] = setting.flag_type
        group.add_argument(setting.flag, **options)
    return parser


def merge_flags_into_additional_config(engine_args, namespace) -> None:
    """Copy explicitly given flags into ``engine_args.additional_config``."""
    given = {setting.key: getattr(namespace, flag_dest(setting)) for setting in SETTINGS
             if hasattr(namespace, flag_dest(setting))}
    if not given:
        return
    additional = engine_args.additional_config
    if not isinstance(additional, dict):
        raise ValueError("--model-local-kv-* flags need additional_config to be a dict, "
                         f"got {type(additional).__name__}")
    additional = dict(additional)  # never mutate the namespace's own dict
    additional[CONFIG_KEY] = merged_section(additional.get(CONFIG_KEY) or {}, given)
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
