"""additional_config["model_local_kv"]: defaults, values, errors naming the key, and the one
table the settings, the flags and the README's flag table come from."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kv_budget.settings import (
    DEFAULT_POLICY,
    KNOWN_KEYS,
    SETTINGS,
    ModelLocalKVSettings,
    Policy,
    settings_from_additional_config,
)
from kv_budget.units import GiB, MiB
from vllm_patches.flags import add_flags


def test_absent_settings_are_the_defaults_and_cap_is_the_default():
    class OtherPluginsConfig:  # vLLM accepts any hashable object as additional_config
        def compute_hash(self) -> str:
            return "x"

    for config in (None, {}, {"model_local_kv": None}, {"other_plugin": {"x": 1}}, OtherPluginsConfig()):
        settings = settings_from_additional_config(config)
        assert settings.policy is DEFAULT_POLICY is Policy.CAP
        assert settings.headroom_bytes is None and settings.margin_bytes is None and settings.report_path is None


def test_values_parse_sizes_with_units_and_plain_bytes():
    settings = settings_from_additional_config(
        {"model_local_kv": {"policy": "warn", "headroom_bytes": "14GiB", "margin_bytes": 512 * MiB,
                            "report_path": "plan.json"}}
    )
    assert settings.policy is Policy.WARN
    assert settings.headroom_bytes == 14 * GiB and settings.margin_bytes == 512 * MiB
    assert settings.report_path == "plan.json"


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"model_local_kv": "cap"}, "must be a dict"),
        ({"model_local_kv": {"policy": "CAP"}}, "['policy'] = 'CAP' is invalid: choose from ['cap', 'warn', 'off', 'reserve']"),
        ({"model_local_kv": {"headroom_bytes": "-1"}}, "['headroom_bytes']"),
        ({"model_local_kv": {"margin_bytes": "1 lightyear"}}, "['margin_bytes']"),
        ({"model_local_kv": {"margin_bytes": True}}, "['margin_bytes']"),
        ({"model_local_kv": {"report_path": 3}}, "['report_path'] = 3 is invalid"),
        ({"model_local_kv": {"headroom": "1GiB"}}, "unknown key(s) ['headroom']"),
        ({"model_local_kv": {"overrides": "decoder/x:layers=2"}}, "['overrides'] = 'decoder/x:layers=2' is invalid"),
        ({"model_local_kv": {"ledger_dir": ""}}, "['ledger_dir'] = '' is invalid: expected a directory or 'off'"),
        ({"model_local_kv": {"share_bytes": "half"}}, "['share_bytes']"),
        ({"model_local_kv": {"overrides": ["decoder/x:layers=none"]}}, "['overrides']: override 'decoder/x:layers=none'"),
        ({"model_local_kv": {"overrides": ["decoder:layers=2"]}}, "expected [STAGE:]OWNER/NAME:FIELD=VALUE"),
        ({"model_local_kv": {"sample_interval_s": -0.5}}, "['sample_interval_s'] = -0.5 is invalid"),
        ({"model_local_kv": {"sample_interval_s": "1s"}}, "['sample_interval_s'] = '1s' is invalid"),
        ({"model_local_kv": {"sample_interval_s": float("inf")}}, "['sample_interval_s'] = inf is invalid"),
    ],
)
def test_bad_values_raise_value_error_naming_the_key(config, expected):
    with pytest.raises(ValueError) as info:
        settings_from_additional_config(config)
    assert expected in str(info.value)


def test_overrides_are_kept_in_order_as_text():
    texts = ["decoder/codec_decoder_request:physical_capacity_positions=72",
             "thinker.apm/whisper_encoder_self_attn:rows_fixed=4"]
    settings = settings_from_additional_config({"model_local_kv": {"overrides": texts}})
    assert settings.overrides == tuple(texts)


def test_ledger_directory_and_share():
    settings = settings_from_additional_config({"model_local_kv": {"ledger_dir": "off", "share_bytes": "48MiB"}})
    assert settings.ledger_dir == "off" and settings.share_bytes == 48 * MiB
    assert settings_from_additional_config({}).ledger_dir is None  # the default runtime directory


def test_sample_interval_defaults_to_the_measured_default_and_zero_turns_sampling_off():
    from kv_budget.settings import DEFAULT_SAMPLE_INTERVAL_S

    assert settings_from_additional_config({}).sample_interval_s == DEFAULT_SAMPLE_INTERVAL_S
    assert settings_from_additional_config({"model_local_kv": {"sample_interval_s": 0}}).sample_interval_s == 0.0
    assert settings_from_additional_config({"model_local_kv": {"sample_interval_s": 0.25}}).sample_interval_s == 0.25


# --- one table: the settings, the flags, the README ---------------------------

def test_the_settings_model_has_one_field_per_row_of_the_table():
    assert tuple(ModelLocalKVSettings.model_fields) == KNOWN_KEYS == tuple(setting.key for setting in SETTINGS)
    assert len(set(KNOWN_KEYS)) == len(KNOWN_KEYS)


def test_the_flag_group_is_the_table():
    parser = add_flags(argparse.ArgumentParser())
    group = next(group for group in parser._action_groups if group.title == "ModelLocalKV")
    assert [action.option_strings[0] for action in group._group_actions] == [setting.flag for setting in SETTINGS]
    args = parser.parse_args(["--model-local-kv-headroom", "1GiB", "--model-local-kv-sample-interval", "0.5",
                              "--model-local-kv-override", "a/b:rows_fixed=2", "--model-local-kv-override",
                              "a/c:rows_fixed=3"])
    assert (args.model_local_kv_headroom, args.model_local_kv_sample_interval) == (GiB, 0.5)
    assert args.model_local_kv_override == ["a/b:rows_fixed=2", "a/c:rows_fixed=3"]
    assert not hasattr(args, "model_local_kv_policy")  # absent unless given


def test_the_readmes_flag_table_lists_every_setting_with_its_key_in_order():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    rows = re.findall(r"^\| `(--model-local-kv-[a-z-]+)(?: ([^`]+))?` \| `(\w+)` \|", readme, re.M)
    expected = [
        (setting.flag, setting.metavar or "{" + ",".join(setting.choices) + "}", setting.key) for setting in SETTINGS
    ]
    assert rows == expected
