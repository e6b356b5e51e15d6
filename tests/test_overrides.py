"""Operator overrides: parsing, applying in order, the plan showing the
declared and the applied value, and refusals that name what exists."""

from __future__ import annotations

import pytest
import torch

from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.override import OverrideError, apply_overrides, parse_override, unmatched_message
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.report import render_plan_table

# 2 x 2 layers x 2 kv heads x 64 head_dim x 71 positions x 4 B
ROW_71 = 2 * 2 * 2 * 64 * 71 * 4
ROW_72 = 2 * 2 * 2 * 64 * 72 * 4


def _collection() -> Collection:
    geometry = dict(layers=2, kv_heads=2, head_dim=64, dtype=torch.float32, physical_capacity_positions=71,
                    capacity_source="sliding_window(72) - 1")
    return Collection(
        specs=(
            OwnedSpec("decoder", ModelLocalKVSpec(name="codec_decoder_request", scope="request",
                                                  rows="max_num_seqs", **geometry)),
            OwnedSpec("thinker.apm", ModelLocalKVSpec(name="whisper_encoder_self_attn", scope="session",
                                                      rows="fixed", rows_fixed=1, rows_reason="one session",
                                                      **geometry)),
            OwnedSpec("", ModelLocalKVSpec(name="talker_llm_static_cache", scope="invocation", rows="fixed",
                                           rows_reason="serialized", **geometry)),
        ),
        failures=(),
    )


def _apply(*texts):
    return apply_overrides(_collection(), [parse_override(t) for t in texts])


def test_parse_reads_owner_name_field_and_typed_value():
    o = parse_override("thinker.apm/whisper_encoder_self_attn:rows_fixed=4")
    assert (o.owner, o.name, o.field, o.value) == ("thinker.apm", "whisper_encoder_self_attn", "rows_fixed", 4)
    assert parse_override("<root>/talker_llm_static_cache:dtype=bfloat16").value is torch.bfloat16
    assert parse_override("/talker_llm_static_cache:rows=max_num_seqs").owner == ""
    assert parse_override("a.b/c:rows_reason=four: one per session").value == "four: one per session"


@pytest.mark.parametrize(
    "text, message",
    [
        ("decoder:physical_capacity_positions=72", "expected [STAGE:]OWNER/NAME:FIELD=VALUE"),
        ("decoder/codec_decoder_request", "expected [STAGE:]OWNER/NAME:FIELD=VALUE"),
        ("decoder/codec_decoder_request:physical_capacity_positions", "expected [STAGE:]OWNER/NAME:FIELD=VALUE"),
        ("decoder/:layers=2", "expected [STAGE:]OWNER/NAME:FIELD=VALUE"),
        ("decoder/codec_decoder_request:name=x", "field 'name' cannot be overridden"),
        ("decoder/codec_decoder_request:positions=72", "field 'positions' cannot be overridden"),
        ("decoder/codec_decoder_request:physical_capacity_positions=0", "0 must be >= 1"),
        ("decoder/codec_decoder_request:layers=two", "'two' is not an integer"),
        ("decoder/codec_decoder_request:dtype=half-ish", "not a torch dtype name"),
        ("decoder/codec_decoder_request:scope=forever", "not one of ['invocation', 'request', 'session', 'model']"),
        (72, "is not a string"),
    ],
)
def test_bad_overrides_say_which_part_is_wrong(text, message):
    with pytest.raises(OverrideError) as info:
        parse_override(text)
    assert message in str(info.value)


def test_applied_overrides_change_the_bytes_and_keep_the_declared_value():
    collection, unmatched = _apply(
        "decoder/codec_decoder_request:physical_capacity_positions=72",
        "thinker.apm/whisper_encoder_self_attn:rows_fixed=4",
    )
    assert unmatched == []
    request, encoder, talker = collection.specs
    assert request.spec.bytes_per_row == ROW_72
    assert request.overridden == (("physical_capacity_positions", 71, 72),)
    assert encoder.spec.row_count(256) == 4 and encoder.overridden == (("rows_fixed", 1, 4),)
    assert talker.overridden == () and talker.spec == _collection().specs[2].spec

    plan = make_plan([budget_worker(collection, headroom_override(100 * ROW_72 + 4 * ROW_71), max_num_seqs=256)],
                     256, "cap")
    assert plan.per_seq_bytes == ROW_72
    assert plan.uncharged_fixed_bytes == 4 * ROW_71 + ROW_71
    assert plan.effective_max_num_seqs == (100 * ROW_72 + 4 * ROW_71 - 5 * ROW_71) // ROW_72 == 99
    lines = {line.name: line for line in plan.declarations}
    assert [o.model_dump() for o in lines["codec_decoder_request"].overrides] == [
        {"field": "physical_capacity_positions", "declared": 71, "applied": 72}]
    table = render_plan_table(plan)
    assert "overridden by the operator: physical_capacity_positions declared 71 -> applied 72" in table
    assert "overridden by the operator: rows_fixed declared 1 -> applied 4" in table


def test_later_overrides_win_and_the_first_declared_value_is_kept():
    collection, _ = _apply(
        "decoder/codec_decoder_request:physical_capacity_positions=80",
        "decoder/codec_decoder_request:physical_capacity_positions=72",
    )
    assert collection.specs[0].spec.physical_capacity_positions == 72
    assert collection.specs[0].overridden == (("physical_capacity_positions", 71, 72),)


def test_root_owner_is_written_as_root_and_rows_can_switch_driver():
    collection, unmatched = _apply("<root>/talker_llm_static_cache:rows=max_num_seqs")
    assert unmatched == []
    spec = collection.specs[2].spec
    assert spec.row_count(64) == 64
    assert collection.specs[2].overridden == (("rows", "fixed", "max_num_seqs"),)


def test_switching_to_fixed_rows_needs_a_reason():
    with pytest.raises(OverrideError, match="rows_reason.*needs a reason"):
        _apply("decoder/codec_decoder_request:rows=fixed")
    collection, _ = _apply("decoder/codec_decoder_request:rows=fixed",
                           "decoder/codec_decoder_request:rows_reason=one request at a time")
    assert collection.specs[0].spec.row_count(256) == 1


def test_an_override_that_matches_nothing_is_returned_and_named_with_what_exists():
    _, unmatched = _apply("decoder/codec_decoder_requests:physical_capacity_positions=72",
                          "thinker/whisper_encoder_self_attn:rows_fixed=4")
    assert [o.text for o in unmatched] == ["decoder/codec_decoder_requests:physical_capacity_positions=72",
                                          "thinker/whisper_encoder_self_attn:rows_fixed=4"]
    message = unmatched_message(unmatched, ["decoder/codec_decoder_request", "thinker.apm/whisper_encoder_self_attn"])
    assert "'decoder/codec_decoder_requests:physical_capacity_positions=72'" in message
    assert "match no declaration; declarations: decoder/codec_decoder_request, thinker.apm/whisper_encoder_self_attn" in message
    assert "the model declares nothing" in unmatched_message(unmatched, [])
