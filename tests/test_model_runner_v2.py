"""vLLM's Model Runner V2 (MRV2: ``vllm/v1/worker/gpu/``) and vLLM-Omni's
``worker_v2`` runners: what kv-budget reaches the model through, checked
against vLLM's real source (the installed vLLM, read live and as files, and
copies of its file with one thing broken), and the refusal a worker running
V2 returns where its model is not at ``worker.model_runner.model``.

No GPU here: vLLM falls back to V1 without Triton, so a V2 runner is never
built. The run-time check is held to runners made from vLLM's own V2 classes
without their ``__init__`` (which needs a device), with only the attributes
it reads set.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from audit_models import REQUEST_ROW_BYTES, RequestDeclaringModel

from kv_budget.plan.planner import Decision
from kv_budget.settings import ModelLocalKVSettings, Policy
from kv_budget.startup import EngineContext, ModelLocalKVPlanningError, checked_results, plan_startup
from vllm_patches import compat
from vllm_patches.compat import (
    InstalledVllm,
    VllmSourceTree,
    model_runner_v2_problem,
    model_runner_v2_problems,
    runs_model_runner_v2,
)
from vllm_patches.compat.model_runner_v2 import MODEL_RUNNER_V2, MODEL_RUNNER_V2_HOOK_POINTS
from vllm_patches.workers import budget_on_worker

ROW = REQUEST_ROW_BYTES
VLLM = {"vllm_version": "0.0.test", "vllm_distribution": "none", "vllm_support": "untested"}
CHECKED_METHODS = ("load_model", "get_model", "execute_model")


# --- against vLLM's source -------------------------------------------------------

@pytest.mark.vllm
def test_the_v2_runner_keeps_the_model_it_loads_and_runs_read_live_and_as_files(installed_root):
    live, files = InstalledVllm(), VllmSourceTree(installed_root)
    assert model_runner_v2_problems(files) == []
    assert model_runner_v2_problems(live) == []
    for name in CHECKED_METHODS:
        seen_live = live.member(MODEL_RUNNER_V2, "GPUModelRunner", name)
        seen_in_files = files.member(MODEL_RUNNER_V2, "GPUModelRunner", name)
        assert (seen_live.kind, seen_live.parameters) == (seen_in_files.kind, seen_in_files.parameters), name
    # vLLM's V1 runner, also named GPUModelRunner, is another module: not what these checks read.
    assert files.member("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "load_model") is not None


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _wrap_the_model_after_loading(cls: ast.ClassDef) -> None:
    """What V1 does (``self.model = CUDAGraphWrapper(self.model, ...)``)."""
    _method(cls, "load_model").body.append(
        ast.parse("self.model = CUDAGraphWrapper(self.model, self.vllm_config)").body[0])


def _load_into_another_attribute(cls: ast.ClassDef) -> None:
    for node in ast.walk(_method(cls, "load_model")):
        if isinstance(node, ast.Attribute) and node.attr == "model" and isinstance(node.value, ast.Name) and (
                node.value.id == "self") and isinstance(node.ctx, ast.Store):
            node.attr = "inner_model"


def _hand_out_another_model(cls: ast.ClassDef) -> None:
    _method(cls, "get_model").body = ast.parse("return self.model_state.model").body


def _run_another_attribute(cls: ast.ClassDef) -> None:
    for node in ast.walk(_method(cls, "execute_model")):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.model":
            node.func = ast.parse("self.runner_model", mode="eval").body


def _edited_copy(root: Path, destination: Path, edit) -> VllmSourceTree:
    relative = Path(*MODEL_RUNNER_V2.split(".")).with_suffix(".py")
    (destination / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(root / relative, destination / relative)
    if edit is not None:
        path = destination / relative
        tree = ast.parse(path.read_text())
        edit(next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner"))
        path.write_text(ast.unparse(tree))
    return VllmSourceTree(destination)


@pytest.mark.vllm
def test_an_unedited_copy_of_the_v2_runner_passes(installed_root, tmp_path):
    assert model_runner_v2_problems(_edited_copy(installed_root, tmp_path, None)) == []


@pytest.mark.vllm
@pytest.mark.parametrize("edit, expected", [
    (_wrap_the_model_after_loading,
     "Model Runner V2 GPUModelRunner.load_model sets self.model to the loaded model, unwrapped (used by planning on "
     "worker.model_runner.model): also sets self.model = CUDAGraphWrapper(...), which kv-budget was not checked "
     "against"),
    (_load_into_another_attribute,
     "GPUModelRunner.load_model sets self.model to the loaded model, unwrapped (used by planning on "
     "worker.model_runner.model): does not set self.model from the model loader's load_model()"),
    (_hand_out_another_model,
     "Model Runner V2 GPUModelRunner.get_model returns self.model (used by planning on worker.model_runner.model): "
     "returns self.model_state.model, not self.model"),
    (_run_another_attribute,
     "Model Runner V2 GPUModelRunner.execute_model calls self.model (used by planning on "
     "worker.model_runner.model): does not call self.model(...)"),
])
def test_a_v2_runner_that_keeps_its_model_elsewhere_is_named(installed_root, tmp_path, edit, expected):
    copy = _edited_copy(installed_root, tmp_path, edit)
    problems = model_runner_v2_problems(copy)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_missing_v2_runner_is_named_for_each_method_read(tmp_path):
    problems = model_runner_v2_problems(VllmSourceTree(tmp_path))
    assert problems == [f"{point.name} (used by planning on worker.model_runner.model): not found"
                        for point in MODEL_RUNNER_V2_HOOK_POINTS]


# --- the run-time check in the worker ------------------------------------------------



class Wrapper:
    """A graph wrapper as V1's ``CUDAGraphWrapper``: holds the model, hands it out through ``unwrap()``."""

    def __init__(self, model):
        self.model = model

    def unwrap(self):
        return self.model


class Opaque:
    """A wrapper with no ``unwrap()``: nothing says what model it runs."""

    def __init__(self, model):
        self.model = model


@pytest.fixture(scope="module")
def v2_runner_classes():
    """vLLM's own V2 GPUModelRunner and its CPU subclass (what a vLLM-Omni
    ``worker_v2`` runner is too: a subclass)."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return GPUModelRunner, CPUModelRunner


def _runner(cls, **attributes):
    runner = object.__new__(cls)  # its __init__ needs a device; the check reads only these
    runner.__dict__.update(attributes)
    return runner


def _worker(runner, rank=0):
    return SimpleNamespace(model_runner=runner, rank=rank, device=torch.device("cpu"))


def _settings(**settings) -> dict:
    return ModelLocalKVSettings(**{"headroom_bytes": 10 * ROW, "ledger_dir": "off", **settings}).model_dump(
        mode="json")


@pytest.mark.vllm
def test_v2_is_told_apart_by_class_not_by_name(v2_runner_classes):
    gpu, cpu = v2_runner_classes
    assert runs_model_runner_v2(_runner(gpu)) and runs_model_runner_v2(_runner(cpu))
    v1 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})  # V1's name, V1's module
    assert not runs_model_runner_v2(v1())
    assert not runs_model_runner_v2(SimpleNamespace(model=None))


@pytest.mark.vllm
def test_a_v1_runner_is_left_to_the_v1_path(v2_runner_classes):
    """Nothing changes for V1: no check, not even of a runner that holds no model."""
    assert model_runner_v2_problem(_worker(SimpleNamespace())) is None
    assert model_runner_v2_problem(SimpleNamespace(rank=0)) is None


@pytest.mark.vllm
@pytest.mark.parametrize("which", [0, 1])
def test_a_v2_runner_holding_its_model_is_planned_on(v2_runner_classes, which):
    """The real V2 ``get_model`` (``return self.model``) agrees with the
    attribute, and the model's declarations are what the plan caps on."""
    model = RequestDeclaringModel()
    worker = _worker(_runner(v2_runner_classes[which], model=model))
    assert model_runner_v2_problem(worker) is None
    result = budget_on_worker(worker, _settings(), 256, 1)
    assert result["problem"] is None and result["declarations"] == ["talker/kv"]
    settings = ModelLocalKVSettings(headroom_bytes=10 * ROW, ledger_dir="off")
    plan = plan_startup(checked_results([result], Policy.CAP), EngineContext(settings, 256, "pid 1: model m", VLLM),
                        started=0.0)
    assert (plan.decision, plan.effective_max_num_seqs) == (Decision.CAPPED, 10)


@pytest.mark.vllm
def test_a_wrapper_that_unwraps_to_the_model_is_accepted(v2_runner_classes):
    gpu, _ = v2_runner_classes
    worker = _worker(_runner(gpu, model=Wrapper(RequestDeclaringModel())))
    assert model_runner_v2_problem(worker) is None
    assert budget_on_worker(worker, _settings(), 256, 1)["declarations"] == ["talker/kv"]


class ServesAnother:
    """A V2 runner whose ``get_model()`` hands out another module than ``.model``."""

    def get_model(self):
        return self.served


@pytest.mark.vllm
def test_what_the_runner_holds_is_named_when_it_is_not_the_model(v2_runner_classes):
    gpu, _ = v2_runner_classes
    where = "vLLM's Model Runner V2 (vllm.v1.worker.gpu.model_runner.GPUModelRunner)"
    assert model_runner_v2_problem(_worker(_runner(gpu))) == (
        f"{where} keeps no model at worker.model_runner.model (none loaded?)")
    assert model_runner_v2_problem(_worker(_runner(gpu, model=Opaque(RequestDeclaringModel())))) == (
        f"{where} keeps a Opaque at worker.model_runner.model, not a torch.nn.Module: kv-budget would find no "
        "declarations in it")
    assert model_runner_v2_problem(_worker(_runner(gpu, model=None))) == (
        f"{where} keeps a NoneType at worker.model_runner.model, not a torch.nn.Module: kv-budget would find no "
        "declarations in it")
    serving = type("OmniRunner", (ServesAnother, gpu), {"__module__": "vllm_omni.worker_v2.test"})
    problem = model_runner_v2_problem(_worker(_runner(serving, model=torch.nn.Identity(), served=RequestDeclaringModel())))
    assert problem == ("vLLM's Model Runner V2 (vllm_omni.worker_v2.test.OmniRunner) keeps its model at get_model() "
                       "(RequestDeclaringModel), not worker.model_runner.model (Identity)")


@pytest.mark.vllm
def test_a_broken_v2_source_refuses_even_a_runner_holding_a_model(v2_runner_classes, installed_root, tmp_path):
    gpu, _ = v2_runner_classes
    copy = _edited_copy(installed_root, tmp_path, _hand_out_another_model)
    problem = model_runner_v2_problem(_worker(_runner(gpu, model=RequestDeclaringModel())), source=copy)
    assert problem.startswith(
        f"vLLM's Model Runner V2 (vllm.v1.worker.gpu.model_runner.GPUModelRunner) on vLLM {compat.vllm_version()} "
        "does not keep its model as kv-budget reads it: Model Runner V2 GPUModelRunner.get_model returns self.model")
    assert problem.endswith("returns self.model_state.model, not self.model")


@pytest.mark.vllm
@pytest.mark.parametrize("policy", [Policy.CAP, Policy.RESERVE, Policy.WARN])
def test_a_v2_worker_without_its_model_refuses_in_one_line(v2_runner_classes, policy):
    """The worker reports a failure instead of a budget; the engine core
    raises on it (under ``warn`` the startup hook catches this one and
    starts unprotected, as for any worker failure)."""
    gpu, _ = v2_runner_classes
    results = [budget_on_worker(_worker(_runner(gpu, model=RequestDeclaringModel()), rank=0), _settings(policy=policy), 256, 1),
               budget_on_worker(_worker(_runner(gpu), rank=1), _settings(policy=policy), 256, 1)]
    assert results[0]["problem"] is None and results[1]["budget"] is None
    assert results[1]["problem"]["kind"] == "failure"
    with pytest.raises(ModelLocalKVPlanningError) as info:
        checked_results(results, policy)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "kv-budget could not plan model-local KV (rank 1: vLLM's Model Runner V2 "
        "(vllm.v1.worker.gpu.model_runner.GPUModelRunner) keeps no model at worker.model_runner.model (none "
        f"loaded?)); policy {policy.value} refuses to start without a plan")


# --- vLLM-Omni 0.30.0's V2 runners and workers -------------------------------------------

@pytest.fixture(scope="module")
def omni() -> Path:
    from peers.vllm_omni.files import OmniFilesUnavailable, omni_root

    try:
        return omni_root() / "vllm_omni"
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are not available: {exc}")


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)}


@pytest.mark.network
def test_vllm_omnis_v2_runners_are_vllms_v2_runner_and_never_rebind_its_model(omni):
    base = omni / "worker_v2" / "omni_model_runner.py"
    imported = {(n.module, a.name) for n in ast.walk(ast.parse(base.read_text())) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    assert (MODEL_RUNNER_V2, "GPUModelRunner") in imported
    bases = {name: [ast.unparse(b) for b in cls.bases] for path in sorted((omni / "worker_v2").glob("*.py"))
             for name, cls in _classes(path).items() if name.endswith("ModelRunner")}
    assert bases == {"OmniGPUModelRunner": ["GPUModelRunner"], "OmniARModelRunner": ["OmniGPUModelRunner"],
                     "OmniGenerationModelRunner": ["OmniGPUModelRunner"]}
    # load_model defers to vLLM's (which sets self.model); nothing in worker_v2 sets self.model itself.
    load = next(m for m in _classes(base)["OmniGPUModelRunner"].body
                if isinstance(m, ast.FunctionDef) and m.name == "load_model")
    assert any(isinstance(n, ast.Call) and ast.unparse(n.func) == "super().load_model" for n in ast.walk(load))
    rebinding = [
        f"{path.name}:{n.lineno}" for path in sorted((omni / "worker_v2").glob("*.py"))
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, (ast.Assign, ast.AnnAssign))
        and "self.model" in [ast.unparse(t) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    ]
    assert rebinding == []
    # (They do swap self.model.forward during capture and put it back: an attribute of the model, not the model.)


@pytest.mark.network
@pytest.mark.parametrize("module, worker, runner", [
    ("gpu_ar_worker.py", "GPUARWorker", "OmniARModelRunner"),
    ("gpu_generation_worker.py", "GPUGenerationWorker", "OmniGenerationModelRunner"),
])
def test_vllm_omnis_workers_keep_their_v2_runner_at_model_runner(omni, module, worker, runner):
    """Under ``if self.use_v2_model_runner:`` (read from vLLM-Omni's own
    ``model_config.use_v2_model_runner``), ``init_device`` builds the V2
    runner into ``self.model_runner``."""
    init = next(m for m in _classes(omni / "worker" / module)[worker].body
                if isinstance(m, ast.FunctionDef) and m.name == "init_device")
    flag = [n for n in ast.walk(init) if isinstance(n, ast.Assign)
            and [ast.unparse(t) for t in n.targets] == ["self.use_v2_model_runner"]]
    assert flag and "self.model_config" in ast.unparse(flag[0].value)
    branch = next(n for n in ast.walk(init)
                  if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_v2_model_runner")
    built = [ast.unparse(n.value.func) for n in ast.walk(branch) if isinstance(n, ast.Assign)
             and [ast.unparse(t) for t in n.targets] == ["self.model_runner"] and isinstance(n.value, ast.Call)]
    assert built[:1] == [runner]


@pytest.mark.network
def test_the_shipped_qwen3_tts_deploy_selects_v2_on_cuda(omni):
    """``model_runner: v2`` at the top; the ``platforms:`` sections put V1
    back on ROCm, NPU, XPU and MUSA, none on CUDA."""
    import yaml

    deploy = yaml.safe_load((omni / "deploy" / "qwen3_tts.yaml").read_text())
    assert deploy["model_runner"] == "v2"
    assert {name: section.get("model_runner") for name, section in deploy["platforms"].items()} == {
        "rocm": "v1", "npu": "v1", "xpu": "v1", "musa": "v1"}
    stage_config = (omni / "config" / "stage_config.py").read_text()
    assert 'engine_args["use_v2_model_runner"] = deploy.model_runner == "v2"' in stage_config
