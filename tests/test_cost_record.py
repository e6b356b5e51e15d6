"""The cost record: what a held sequence cost the device, kept for the same engine's next start."""

from __future__ import annotations

import json
import logging
import os

import pytest

from kv_budget.watch.cost_record import HeldCost, cost_record_path, read_cost_record, write_cost_record

ENGINE = {"model": "/models/talker", "max_num_seqs": "256", "declared_per_seq_bytes": "1114112"}
COSTS = {0: HeldCost(most_held=70, cost_per_seq_bytes=2_400_000)}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_written_record_is_read_back_by_the_same_engine_only(tmp_path):
    directory = tmp_path / "runtime"
    path = write_cost_record(directory, ENGINE, COSTS)
    assert path.parent == directory and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    record = read_cost_record(directory, ENGINE)
    assert record is not None and record.ranks == COSTS and record.engine == ENGINE
    other = {**ENGINE, "max_num_seqs": "128"}
    assert cost_record_path(directory, other) != path and read_cost_record(directory, other) is None
    assert read_cost_record(tmp_path / "empty", ENGINE) is None


@pytest.mark.parametrize("text, why", [
    ("{not json", "invalid field"),
    (json.dumps({"engine": ENGINE, "ranks": {"0": {"most_held": -1, "cost_per_seq_bytes": 5}}, "written_at": 1.0}),
     "greater than or equal to 1"),
    (json.dumps({"engine": ENGINE, "ranks": {"0": {"most_held": 5, "cost_per_seq_bytes": 1 << 60}},
                 "written_at": 1.0}), "less than or equal to"),
    (json.dumps({"engine": ENGINE, "ranks": {"0": {"most_held": 5, "cost_per_seq_bytes": "5"}}, "written_at": 1.0}),
     "valid integer"),
    (json.dumps({"engine": ENGINE, "ranks": {}, "written_at": 1.0, "extra": 1}), "Extra inputs"),
    (json.dumps({"engine": {**ENGINE, "model": "/models/other"}, "ranks": {}, "written_at": 1.0}),
     "another engine's fingerprint"),
])
def test_a_record_no_engine_wrote_is_set_aside_with_one_warning(tmp_path, caplog, text, why):
    """A file that is not what an engine writes (negative, huge or non-integer
    figures, unknown fields, another engine's fingerprint under this one's
    name) admits nothing: the first burst is the guess, the file is moved
    aside so the next write starts clean."""
    path = write_cost_record(tmp_path, ENGINE, COSTS)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert read_cost_record(tmp_path, ENGINE) is None
    (warning,) = _warnings(caplog)
    assert str(path) in warning and why in warning and "moved to" in warning
    assert not path.exists() and len(list(tmp_path.glob(f"{path.name}.corrupt-*"))) == 1


def test_a_link_or_a_group_writable_record_is_refused_and_its_target_untouched(tmp_path, caplog):
    """Only the engine's own user may make it admit more: a link planted at
    the record is not followed, a record others may write is not read, a
    directory others may write is not used, and none stops the engine."""
    path = cost_record_path(tmp_path, ENGINE)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"engine": ENGINE, "ranks": {"0": {"most_held": 9, "cost_per_seq_bytes": 1}},
                                  "written_at": 1.0}))
    path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert read_cost_record(tmp_path, ENGINE) is None
        write_cost_record(tmp_path, ENGINE, COSTS)  # a rename replaces the link, never writes through it
    assert "a symbolic link, not followed" in _warnings(caplog)[0]
    assert json.loads(target.read_text())["ranks"]["0"]["most_held"] == 9 and not path.is_symlink()
    os.chmod(path, 0o620)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert read_cost_record(tmp_path, ENGINE) is None
    assert "is writable by others" in _warnings(caplog)[0]
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        assert read_cost_record(open_dir, ENGINE) is None
    assert "no cost record is read" in _warnings(caplog)[0] and str(open_dir) in _warnings(caplog)[0]
