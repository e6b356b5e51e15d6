"""The frontend glue (:mod:`vllm_patches.frontend`) against the installed
vLLM, in process, without an engine: the cap taken into a real
``VllmConfig``, the stat-logger entry point as vLLM loads it, and the stat
logger publishing a real status file into prometheus_client's registry.
``tests/test_engine_serving.py`` does the same through a running api_server."""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING

import pytest
import torch

import vllm_patches
import kv_budget_demo
from kv_budget import ModelLocalKVSpec
from kv_budget.collect.model import Collection, OwnedSpec
from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
from kv_budget.watch.status import STATUS_DIR_ENV, EngineStatus, status_path, write_status
from vllm_patches.compat import checked_vllm
from vllm_patches.patching import PATCH_MARK

if TYPE_CHECKING:
    from vllm.config import VllmConfig

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def registered():
    pytest.importorskip("vllm")
    import vllm_patches.plugin  # imports vLLM: at run time, so that collecting this module does not

    vllm_patches.plugin.register()
    kv_budget_demo.register()  # the configs below name the demo architecture


@pytest.fixture(scope="module")
def frontend():
    """:mod:`vllm_patches.frontend`, which imports vLLM: imported when a test
    runs, so that collecting this module (which every fast run does before
    deselecting it) imports no vLLM."""
    from vllm_patches import frontend

    return frontend


def _scheduler_config(max_num_seqs: int, active: int | None = None) -> VllmConfig:
    from vllm.config import SchedulerConfig, VllmConfig

    extra = {"max_num_active_seqs": active} if checked_vllm().features.max_num_active_seqs else {}
    return VllmConfig(scheduler_config=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=256, is_encoder_decoder=False, **extra))


def test_the_ready_response_patch_is_applied_once():
    from vllm.v1.engine.core_client import MPClient

    patched = MPClient._apply_ready_response
    assert getattr(patched, PATCH_MARK, False)
    assert not getattr(patched.__wrapped__, PATCH_MARK, False)
    vllm_patches.plugin._registered = False  # a process that loads the plugin again
    vllm_patches.plugin.register()
    assert MPClient._apply_ready_response is patched


def test_the_frontend_keeps_the_smallest_engine_value_and_never_raises_it(frontend, caplog):
    config = _scheduler_config(256, active=200)
    with caplog.at_level("INFO", logger="vllm.kv_budget"):
        first = frontend.lower_frontend_max_num_seqs(config, 90, engine_index=0)
        assert frontend.lower_frontend_max_num_seqs(config, 120, engine_index=1) == []  # data parallel: a larger one
        assert frontend.lower_frontend_max_num_seqs(config, 256, engine_index=2) == []  # an engine that was not capped
        last = frontend.lower_frontend_max_num_seqs(config, 60, engine_index=3)
    assert config.scheduler_config.max_num_seqs == 60
    if checked_vllm().features.max_num_active_seqs:
        assert first == ["max_num_seqs 256 -> 90", "max_num_active_seqs 200 -> 90"]
        assert last == ["max_num_seqs 90 -> 60", "max_num_active_seqs 90 -> 60"]
        assert config.scheduler_config.max_num_active_seqs == 60
        assert "kv-budget: frontend max_num_seqs 256 -> 90; max_num_active_seqs 200 -> 90 (engine 0's ready " \
               "response)" in caplog.text
    else:
        assert (first, last) == (["max_num_seqs 256 -> 90"], ["max_num_seqs 90 -> 60"])
        assert "kv-budget: frontend max_num_seqs 256 -> 90 (engine 0's ready response)" in caplog.text
    assert "engine 1's" not in caplog.text and "engine 3's ready response" in caplog.text


def test_the_stat_logger_joins_an_async_llm_only_where_it_logs_stats(frontend):
    """A ``vllm.stat_logger_plugins`` entry point would turn stats on under
    ``--disable-log-stats``; the logger comes through ``stat_loggers``."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    assert frontend.KvBudgetStatLogger not in load_stat_logger_plugin_factories()
    assert getattr(AsyncLLM.__init__, PATCH_MARK, False)
    vllms_init = inspect.signature(inspect.unwrap(AsyncLLM.__init__))
    calls = []

    def recorder(*args, **kwargs):
        calls.append(vllms_init.bind(*args, **kwargs).arguments)

    recorder.__signature__ = vllms_init
    init = frontend.stat_logger_where_stats_are_on(recorder)
    init("self", "config", "executor", True)
    init("self", "config", "executor", log_stats=False, stat_loggers=["theirs"])
    init("self", "config", "executor", False)
    init("self", "config", "executor", True, stat_loggers=["theirs"])
    assert [call.get("stat_loggers") for call in calls] == [
        [frontend.KvBudgetStatLogger], ["theirs"], None, ["theirs", frontend.KvBudgetStatLogger]]


# --- the stat logger on a real status file ---

ROW = 2 * 64 * 4


def _status(model: str, engine_index: int) -> EngineStatus:
    spec = ModelLocalKVSpec(name="kv", layers=1, kv_heads=1, head_dim=64, dtype=torch.float32,
                            physical_capacity_positions=100, capacity_source="test", scope="request",
                            rows="max_num_seqs")
    worker = budget_worker(Collection((OwnedSpec("talker", spec),), ()), headroom_override(7 * 100 * ROW + 1),
                           max_num_seqs=256)
    return EngineStatus(engine_index=engine_index, model=model, pid=1, updated_unix_s=1.0,
                        plan=make_plan([worker], 256, "cap"))


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> VllmConfig:
    from vllm.config import ModelConfig, VllmConfig

    from kv_budget_demo.checkpoint import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint")
    return VllmConfig(model_config=ModelConfig(model=str(checkpoint), max_model_len=256,
                                               served_model_name="demo-served"))


def test_the_stat_logger_publishes_the_status_file_of_its_engine(frontend, model_config, tmp_path, monkeypatch,
                                                                  caplog):
    from prometheus_client import REGISTRY

    labels = {"model_name": "demo-served", "engine": "3"}
    monkeypatch.delenv(STATUS_DIR_ENV, raising=False)
    stat_logger = frontend.KvBudgetStatLogger(model_config, engine_index=3)
    assert stat_logger.refresh() == 0  # no status directory: nothing to publish, no error

    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    assert stat_logger.refresh() == 0  # no file yet
    assert REGISTRY.get_sample_value("kv_budget:startup_max_num_seqs", labels) is None

    model = model_config.model_config.model
    write_status(tmp_path, _status(model, engine_index=0))  # another engine's file: not this logger's
    write_status(tmp_path, _status(model, engine_index=3))
    stat_logger.log_engine_initialized()
    assert REGISTRY.get_sample_value("kv_budget:configured_max_num_seqs", labels) == 256
    assert REGISTRY.get_sample_value("kv_budget:startup_max_num_seqs", labels) == 7
    assert REGISTRY.get_sample_value("kv_budget:per_sequence_bytes", {**labels, "rank": "0"}) == 100 * ROW
    assert REGISTRY.get_sample_value("kv_budget:startup_max_num_seqs", {**labels, "engine": "0"}) is None
    assert stat_logger.refresh() == 0  # the file did not change: not read again

    status_path(tmp_path, model, 3).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="vllm.kv_budget"):
        for _ in range(3):
            stat_logger.log()
            stat_logger.record(None, None)
    assert caplog.text.count("kv-budget: metrics not published") == 1
    assert "not a kv-budget engine status" in caplog.text
    assert REGISTRY.get_sample_value("kv_budget:startup_max_num_seqs", labels) == 7  # the last good figures
