"""`kv-budget plan --deploy`: vLLM-Omni's shipped deploy files, its admission
ledger, model-local KV on top, the split rule, exit codes.

The deploy files are vLLM-Omni 0.30.0's own, from its wheel
(``peers.vllm_omni.files.omni_root()``). The admission terms are checked
against vLLM-Omni's ``evaluate()`` itself on the same stage demands, and
against figures worked out by hand here (never read back from the code under
test)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kv_budget.cli import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main
from kv_budget.collect.presets import preset_collection
from kv_budget.collect.specfile import load_spec_file
from kv_budget.plan.deploy import StageDeclarations, plan_deploy
from kv_budget.plan.deploy_file import DeployError, load_deploy
from kv_budget.plan.planner import Decision
from kv_budget.units import GiB, MiB
from peers.vllm_omni.files import OmniFilesUnavailable, import_omni_module

QWEN3_TTS_PER_SEQ = 2 * (2 * 8 * 16 * 64 * 71 * 2)
"""Two bfloat16 rows (retained + working copy) of 8 layers x 16 kv heads x
head_dim 64 x 71 positions, K and V: 4,653,056 B."""
QWEN3_TTS_CHARGED = 5 * (2 * 8 * 16 * 64 * 71 * 2)
MIMO_PER_SEQ = 2 * 16 * 8 * 128 * 11 * 2  # 720,896 B
MIMO_CHARGED = 261 * MIMO_PER_SEQ  # 188,153,856 B: the graph pool
MINICPM_FIXED = 2 * 24 * 16 * 64 * 1500 * 2  # 147,456,000 B: one streaming session


def run(*args):
    """``kv-budget ARGS`` in process (each console-script start imports torch:
    seconds); ``tests/test_cli.py`` runs the console script itself."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def admission():
    """vLLM-Omni's own admission module (evaluate, StageDemand, graph_reserve_bytes)."""
    try:
        return import_omni_module("vllm_omni.engine.stage_admission")
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are unavailable: {exc}")
    except ImportError as exc:  # its vllm.logger / vllm.utils.mem_utils imports
        pytest.skip(f"vllm_omni.engine.stage_admission cannot be imported here ({exc}); "
                    "the hand-computed tests still check the same terms")


def write_yaml(tmp_path, text, name="deploy.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def declared(stage: int, preset: str) -> dict[int, StageDeclarations]:
    return {stage: StageDeclarations(stage, f"preset {preset}", preset_collection(preset))}


# ---- hand-computed figures on the shipped files ------------------------------


@pytest.mark.network
def test_qwen3_tts_on_80GiB_by_hand(deploy_dir):
    plan = plan_deploy(load_deploy(deploy_dir / "qwen3_tts.yaml"), {0: 80 * GiB},
                       declared(1, "qwen3-tts-async-chunk"))
    (device,) = plan.devices
    # 0.3 x 80 GiB = 24 GiB per stage; neither stage runs eager: 2 x 2 GiB graph reserve.
    assert [e.requested_bytes for e in device.stages] == [24 * GiB, 24 * GiB]
    assert device.requested_bytes == 48 * GiB
    assert device.graph_reserve_bytes == 4 * GiB
    assert device.external_reserve_bytes == GiB and device.margin_bytes == GiB
    assert device.required_bytes == 54 * GiB and device.admission_fits
    assert device.charged_bytes == QWEN3_TTS_CHARGED == 11_632_640  # reported, not subtracted
    assert device.left_for_per_seq_bytes == 26 * GiB
    assert device.per_seq_demand_bytes == 64 * QWEN3_TTS_PER_SEQ == 297_795_584
    assert device.free_bytes == 26 * GiB - 297_795_584
    assert device.fits and plan.fits
    stage0, stage1 = plan.stages
    assert stage0.declarations_source is None and stage0.safe_max_num_seqs is None
    assert stage1.per_seq_bytes == QWEN3_TTS_PER_SEQ and stage1.charged_bytes == QWEN3_TTS_CHARGED
    assert (stage1.configured_max_num_seqs, stage1.safe_max_num_seqs, stage1.effective_max_num_seqs) == (64, 64, 64)
    assert stage1.decision is Decision.OK


@pytest.mark.network
def test_mimo_audio_on_141GiB_by_hand(deploy_dir):
    plan = plan_deploy(load_deploy(deploy_dir / "mimo_audio.yaml"), {0: 141 * GiB}, declared(0, "mimo-audio"))
    (device,) = plan.devices
    stage0 = 141 * GiB // 2  # 0.5 x 141 GiB = 75,698,798,592 B exactly
    stage1 = 141 * GiB * 3 // 10  # 0.3 x 141 GiB = 45,419,279,155.2 B -> 45,419,279,155
    assert [e.requested_bytes for e in device.stages] == [stage0, stage1] == [75_698_798_592, 45_419_279_155]
    assert device.graph_reserve_bytes == 0  # both stages enforce_eager: true
    assert device.required_bytes == stage0 + stage1 + 2 * GiB
    # The graph pool is charged already (captured while the model loads): not subtracted.
    assert device.charged_bytes == MIMO_CHARGED == 188_153_856
    assert device.uncharged_fixed_bytes == 0
    assert device.left_for_per_seq_bytes == 141 * GiB - stage0 - stage1 - 2 * GiB
    assert device.model_local_bytes == MIMO_PER_SEQ  # max_num_seqs 1
    assert [(s.configured_max_num_seqs, s.safe_max_num_seqs) for s in plan.stages] == [(1, 1), (1, None)]


@pytest.mark.network
def test_minicpmo_on_80GiB_by_hand(deploy_dir):
    plan = plan_deploy(load_deploy(deploy_dir / "minicpmo_4_5.yaml"), {0: 80 * GiB},
                       declared(0, "minicpm-o-streaming"))
    (device,) = plan.devices
    # 0.55 x 80 = 44 GiB, 0.15 x 80 = 12 GiB, 0.18 x 80 GiB = 15,461,882,265.6 B -> 15,461,882,265
    assert [e.requested_bytes for e in device.stages] == [44 * GiB, 12 * GiB, 15_461_882_265]
    assert device.graph_reserve_bytes == 4 * GiB  # stages 0 and 1; stage 2 is enforce_eager
    required = 56 * GiB + 15_461_882_265 + 4 * GiB + 2 * GiB
    assert device.required_bytes == required == 82_033_875_353
    assert device.uncharged_fixed_bytes == MINICPM_FIXED
    assert device.left_for_per_seq_bytes == 80 * GiB - required - MINICPM_FIXED
    assert device.fits
    assert plan.stages[0].safe_max_num_seqs is None  # nothing per sequence and the session fits
    assert plan.stages[0].effective_max_num_seqs == 4


def test_requested_is_evaluates_float_arithmetic(tmp_path):
    """25 GiB x 0.29 is 7,784,628,224 B exactly, but vLLM-Omni computes
    int(capacity * utilization) in floating point: one byte less."""
    path = write_yaml(tmp_path, "stages:\n  - stage_id: 0\n    devices: '0'\n    gpu_memory_utilization: 0.29\n")
    plan = plan_deploy(load_deploy(path), {0: 25 * GiB})
    assert plan.devices[0].requested_bytes == 7_784_628_223


# ---- against vLLM-Omni's own evaluate() ---------------------------------------


def omni_ledger(admission, deploy, capacities):
    """vLLM-Omni's ledger for the same stages: demands built from the file's
    settings, graph reserve from its own graph_reserve_bytes()."""
    demands = []
    for stage in deploy.stages:
        config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=stage.enforce_eager),
            compilation_config=SimpleNamespace(cudagraph_mode=stage.cudagraph_mode),
        )
        for replica, devices in enumerate(stage.replicas):
            demands.append(admission.StageDemand(
                stage_id=stage.stage_id, replica_id=replica, device_ids=list(devices),
                utilization=stage.gpu_memory_utilization,
                graph_reserve_bytes=admission.graph_reserve_bytes(config),
            ))
    try:
        return admission.evaluate(demands, dict(capacities)), True
    except admission.StageAdmissionError:
        pass
    # evaluate() raises on over-subscription. Its ledger, all the same: run it
    # with a margin that admits anything, then put its default margin back.
    ledgers = admission.evaluate(demands, dict(capacities), safety_margin_bytes=-(1 << 60))
    for ledger in ledgers.values():
        ledger.safety_margin_bytes = admission._DEFAULT_SAFETY_MARGIN_BYTES
    return ledgers, False


def assert_same_terms(admission, deploy, capacities):
    ours = plan_deploy(deploy, capacities)
    theirs, admitted = omni_ledger(admission, deploy, capacities)
    assert sorted(theirs) == [d.device for d in ours.devices]
    for device in ours.devices:
        ledger = theirs[device.device]
        assert device.capacity_bytes == ledger.capacity_bytes
        assert device.requested_bytes == ledger.kv_budget_bytes
        assert device.graph_reserve_bytes == ledger.graph_reserve_bytes
        assert device.external_reserve_bytes == ledger.external_reserve_bytes
        assert device.margin_bytes == ledger.safety_margin_bytes
        assert device.required_bytes == ledger.required_bytes
        assert device.admission_fits == ledger.fits
    assert admitted == all(d.admission_fits for d in ours.devices)
    return ours


@pytest.mark.network
@pytest.mark.vllm  # vLLM-Omni's stage_admission imports vllm.logger and vllm.utils.mem_utils
@pytest.mark.parametrize("name", ["qwen3_tts.yaml", "mimo_audio.yaml", "minicpmo_4_5.yaml",
                                  "qwen3_tts_high_concurrency_mrv2_single_gpu.yaml", "minicpmo_4_5_turn.yaml"])
@pytest.mark.parametrize("gib", [8, 80, 141])
def test_admission_terms_match_vllm_omni_evaluate(admission, deploy_dir, name, gib):
    deploy = load_deploy(deploy_dir / name)
    ours = assert_same_terms(admission, deploy, {0: gib * GiB})
    if gib == 8:  # at least 0.6 x 8 GiB + 2 GiB of reserves, more than 8 GiB: over-subscribed
        assert not ours.devices[0].admission_fits and not ours.fits


@pytest.mark.network
@pytest.mark.vllm  # as above: stage_admission imports vLLM
def test_admission_terms_match_with_platform_replicas_and_tensor_parallel(admission, deploy_dir, tmp_path):
    deploy = load_deploy(deploy_dir / "minicpmo_4_5_3gpu_stage1_replicas.yaml", platform="cuda")
    assert_same_terms(admission, deploy, {0: 80 * GiB, 1: 24 * GiB, 2: 48 * GiB})
    path = write_yaml(tmp_path, """
stages:
  - {stage_id: 0, devices: "0,1", tensor_parallel_size: 2, gpu_memory_utilization: 0.35}
  - {stage_id: 1, devices: "0", num_replicas: 2, gpu_memory_utilization: 0.29, enforce_eager: true}
  - {stage_id: 2, devices: "1", gpu_memory_utilization: 0.2, compilation_config: {cudagraph_mode: NONE}}
""")
    deploy = load_deploy(path)
    assert [s.replicas for s in deploy.stages] == [[[0, 1]], [[0], [1]], [[1]]]
    assert_same_terms(admission, deploy, {0: 25 * GiB, 1: 45 * GiB})


# ---- base_config and platforms --------------------------------------------------


@pytest.mark.network
def test_base_config_chain_of_three_files(deploy_dir):
    """qwen3_tts_high_concurrency_mrv2_single_gpu.yaml -> ..._mrv2.yaml ->
    qwen3_tts_high_concurrency.yaml: the overlay moves stage 1 from device 1
    to device 0 with max_num_seqs 32; the middle file turns stage 1's
    enforce_eager (true in the base) off."""
    deploy = load_deploy(deploy_dir / "qwen3_tts_high_concurrency_mrv2_single_gpu.yaml")
    assert [Path(p).name for p in deploy.base_files] == [
        "qwen3_tts_high_concurrency_mrv2.yaml", "qwen3_tts_high_concurrency.yaml"]
    stage0, stage1 = deploy.stages
    assert (stage0.replicas, stage0.max_num_seqs, stage0.gpu_memory_utilization) == ([[0]], 128, 0.3)
    assert (stage1.replicas, stage1.max_num_seqs, stage1.gpu_memory_utilization) == ([[0]], 32, 0.3)
    assert stage1.enforce_eager is False and stage1.captures_cuda_graphs
    plan = plan_deploy(deploy, {0: 80 * GiB}, declared(1, "qwen3-tts-async-chunk"))
    assert plan.devices[0].per_seq_demand_bytes == 32 * QWEN3_TTS_PER_SEQ


@pytest.mark.network
def test_platform_overrides_apply_only_when_asked(deploy_dir):
    plain = load_deploy(deploy_dir / "minicpmo_4_5.yaml")
    cuda = load_deploy(deploy_dir / "minicpmo_4_5.yaml", platform="cuda")
    assert plain.stages[1].kv_cache_memory_bytes is None
    assert cuda.stages[1].kv_cache_memory_bytes == 2 * GiB
    assert "platforms.cuda" in cuda.platform_note
    # The inheriting file sets it back to null under cuda.
    replicas = load_deploy(deploy_dir / "minicpmo_4_5_3gpu_stage1_replicas.yaml", platform="cuda")
    assert replicas.stages[1].kv_cache_memory_bytes is None
    assert replicas.stages[1].replicas == [[1], [2]]  # devices "1,2" as the pool of 2 replicas
    # rocm turns qwen3_tts's stage 1 eager: no graph reserve for it there.
    rocm = load_deploy(deploy_dir / "qwen3_tts.yaml", platform="rocm")
    assert [s.captures_cuda_graphs for s in rocm.stages] == [True, False]
    none = load_deploy(deploy_dir / "qwen3_tts.yaml", platform="cuda")
    assert "no platforms.cuda section" in none.platform_note


def test_kv_cache_memory_bytes_beyond_the_share_is_charged(tmp_path):
    path = write_yaml(tmp_path, """
stages:
  - {stage_id: 0, devices: "0", gpu_memory_utilization: 0.25, enforce_eager: true, kv_cache_memory_bytes: 6442450944}
""")
    device = plan_deploy(load_deploy(path), {0: 16 * GiB}).devices[0]
    assert device.requested_bytes == 4 * GiB  # vLLM-Omni's term: the share
    assert device.kv_cache_excess_bytes == 2 * GiB  # the 6 GiB pool alone exceeds it
    assert device.left_for_per_seq_bytes == 16 * GiB - 4 * GiB - 2 * GiB - 2 * GiB


# ---- the split rule ---------------------------------------------------------------


TWO_DECLARING = """
stages:
  - {stage_id: 0, devices: "0", gpu_memory_utilization: 0.25, enforce_eager: true, max_num_seqs: 256}
  - {stage_id: 1, devices: "0", gpu_memory_utilization: 0.25, enforce_eager: true, max_num_seqs: 128}
"""


def spec(tmp_path, name, *entries):
    path = tmp_path / name
    path.write_text(json.dumps(list(entries)))
    return path


def row(name, layers, scope="request", rows="max_num_seqs", **extra):
    """bfloat16, 1 kv head x head_dim 64 x 4096 positions: 1 MiB per layer."""
    return dict(name=name, layers=layers, kv_heads=1, head_dim=64, dtype="bfloat16",
                physical_capacity_positions=4096, capacity_source="test", scope=scope, rows=rows, **extra)


@pytest.fixture()
def two_declaring(tmp_path):
    """Stage 0: 64 MiB per sequence x 256 = 16 GiB demand. Stage 1: 32 MiB
    per sequence x 128 = 4 GiB demand, plus a fixed 512 MiB."""
    path = write_yaml(tmp_path, TWO_DECLARING)
    s0 = spec(tmp_path, "s0.json", row("a", 64))
    s1 = spec(tmp_path, "s1.json", row("b", 32), row("c", 512, scope="session", rows="fixed",
                                                       rows_fixed=1, rows_reason="one"))
    return path, s0, s1


def test_split_is_proportional_to_configured_demand(two_declaring):
    path, s0, s1 = two_declaring
    declarations = {0: StageDeclarations(0, "s0", load_spec_file(s0)),
                    1: StageDeclarations(1, "s1", load_spec_file(s1))}
    plan = plan_deploy(load_deploy(path), {0: 20 * GiB}, declarations)
    device = plan.devices[0]
    # 20 GiB - 2 x 5 GiB - 2 GiB reserves - 512 MiB fixed = 7680 MiB left, for 20480 MiB demanded.
    assert device.left_for_per_seq_bytes == 7680 * MiB
    assert device.per_seq_demand_bytes == 20 * GiB
    # Shares 7680 x 16/20 = 6144 MiB -> 96 sequences; 7680 x 4/20 = 1536 MiB -> 48 sequences.
    assert [e.share_bytes for e in device.stages] == [6144 * MiB, 1536 * MiB]
    assert [s.safe_max_num_seqs for s in plan.stages] == [96, 48]
    assert [s.decision for s in plan.stages] == [Decision.CAPPED, Decision.CAPPED]
    assert device.model_local_bytes == 512 * MiB + 96 * 64 * MiB + 48 * 32 * MiB
    assert device.free_bytes == 0 and device.fits
    warned = plan_deploy(load_deploy(path), {0: 20 * GiB}, declarations, policy="warn")
    assert [s.effective_max_num_seqs for s in warned.stages] == [256, 128]
    assert warned.devices[0].free_bytes == 7680 * MiB - 20 * GiB


def test_cli_table_and_json_keys(two_declaring):
    path, s0, s1 = two_declaring
    result = run("plan", "--deploy", path, "--stage-declarations", f"0={s0}",
                 "--stage-declarations", f"1={s1}", "--device-memory-of", "0=20GiB", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    plan = json.loads(result.stdout)
    for key in ("device", "capacity_bytes", "requested_bytes", "graph_reserve_bytes", "external_reserve_bytes",
                "margin_bytes", "model_local_bytes", "free_bytes", "fits"):
        assert key in plan["devices"][0], key
    for key in ("stage_id", "devices", "configured_max_num_seqs", "safe_max_num_seqs", "per_seq_bytes",
                "uncharged_fixed_bytes", "charged_bytes"):
        assert key in plan["stages"][0], key
    assert plan["devices"][0]["capacity_bytes"] == 20 * GiB
    assert [s["safe_max_num_seqs"] for s in plan["stages"]] == [96, 48]
    table = run("plan", "--deploy", path, "--stage-declarations", f"0={s0}", "--stage-declarations", f"1={s1}",
                "--device-memory", "20GiB")
    assert table.returncode == EXIT_OK
    assert "int(21,474,836,480 x 0.25) = 5,368,709,120 B (5120.00 MiB)" in table.stdout
    assert "8,053,063,680 B (7680.00 MiB)" in table.stdout  # left for per-sequence KV
    assert "model-local KV share on device 0: 96" in table.stdout


# ---- exit codes ---------------------------------------------------------------------


def test_infeasible_model_local_kv_exits_3(two_declaring):
    """5152 MiB: admitted by vLLM-Omni (2576 + 2048 MiB <= 5152 MiB), but only
    16 MiB is left after the fixed 512 MiB: not one 64 or 32 MiB sequence."""
    path, s0, s1 = two_declaring
    result = run("plan", "--deploy", path, "--stage-declarations", f"0={s0}",
                 "--stage-declarations", f"1={s1}", "--device-memory", "5152MiB")
    assert result.returncode == EXIT_INFEASIBLE
    assert "Traceback" not in result.stderr
    assert "device 0: not even one sequence fits for stage 0" in result.stderr
    assert "admitted" in result.stdout
    warn = run("plan", "--deploy", path, "--stage-declarations", f"0={s0}", "--stage-declarations", f"1={s1}",
               "--device-memory", "5152MiB", "--policy", "warn")
    assert warn.returncode == EXIT_OK


@pytest.mark.network
def test_oversubscribed_device_exits_3(deploy_dir):
    result = run("plan", "--deploy", deploy_dir / "minicpmo_4_5.yaml", "--device-memory", "16GiB")
    assert result.returncode == EXIT_INFEASIBLE
    # 0.55 + 0.15 + 0.18 of 16 GiB, 4 GiB of graph reserve, 2 GiB of reserves:
    required = int(16 * GiB * 0.55) + int(16 * GiB * 0.15) + int(16 * GiB * 0.18) + 6 * GiB
    assert f"vLLM-Omni's admission needs {required:,} B > capacity {16 * GiB:,} B" in result.stderr


@pytest.mark.parametrize("text, key, value", [
    ("stages:\n  - {stage_id: 0, devices: '0', gpu_memory_utilization: 1.5}\n",
     "stages[stage_id=0].gpu_memory_utilization", "1.5"),
    ("stages:\n  - {stage_id: 0, devices: cpu}\n", "stages[stage_id=0].devices", "'cpu'"),
    ("stages:\n  - {stage_id: 0, devices: '0', engine_args: {max_num_seqs: 0}}\n",
     "stages[stage_id=0].engine_args.max_num_seqs", "0"),
    ("base_config: missing.yaml\n", "base_config", "'missing.yaml'"),
    ("stages:\n  - {stage_id: 0, devices: '0,1,2', num_replicas: 2}\n", "stages[stage_id=0].devices", "'0,1,2'"),
])
def test_bad_deploy_file_exits_2_naming_file_key_and_value(tmp_path, text, key, value):
    path = write_yaml(tmp_path, text)
    result = run("plan", "--deploy", path, "--device-memory", "80GiB")
    assert result.returncode == EXIT_BAD_INPUT
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert str(path) in result.stderr and key in result.stderr and value in result.stderr


def test_bad_input_in_a_base_file_names_both_files(tmp_path):
    write_yaml(tmp_path, "stages:\n  - {stage_id: 0, devices: '0', gpu_memory_utilization: 2}\n", "base.yaml")
    path = write_yaml(tmp_path, "base_config: base.yaml\nstages:\n  - {stage_id: 0, max_num_seqs: 8}\n")
    with pytest.raises(DeployError) as info:
        load_deploy(path)
    assert str(path) in str(info.value) and "base.yaml" in str(info.value)
    assert "gpu_memory_utilization = 2" in str(info.value)


@pytest.mark.network
@pytest.mark.parametrize("args, expected", [
    (["--preset", "mimo-audio"], "not allowed with argument"),
    (["--margin-bytes", "1GiB"], "--margin-bytes does not apply to --deploy"),
    (["--max-num-seqs", "8"], "--max-num-seqs does not apply to --deploy"),
    (["--override", "a/b:rows_fixed=2"], "--override does not apply to --deploy"),
    (["--stage-declarations", "7=mimo-audio"],
     "declarations for stage 7 (preset mimo-audio): the file has stages [0, 1]"),
    (["--stage-declarations", "0=no-such-thing"], "is neither a preset"),
    (["--device-memory-of", "3=80GiB"], "--device-memory-of names device(s) [3]"),
])
def test_deploy_option_errors_exit_2(deploy_dir, args, expected):
    result = run("plan", "--deploy", deploy_dir / "mimo_audio.yaml", "--device-memory", "80GiB", *args)
    assert result.returncode == EXIT_BAD_INPUT
    assert expected in result.stderr and "Traceback" not in result.stderr


@pytest.mark.network
def test_missing_device_size_and_deploy_only_options(deploy_dir):
    result = run("plan", "--deploy", deploy_dir / "mimo_audio.yaml")
    assert result.returncode == EXIT_BAD_INPUT and "device 0 (stages [0, 1]) has no size" in result.stderr
    result = run("plan", "--preset", "mimo-audio", "--device-memory", "80GiB", "--platform", "cuda")
    assert result.returncode == EXIT_BAD_INPUT and "--platform applies to --deploy FILE only" in result.stderr


def test_declaring_stage_without_max_num_seqs_is_bad_input(tmp_path):
    path = write_yaml(tmp_path, "stages:\n  - {stage_id: 0, devices: '0'}\n")
    result = run("plan", "--deploy", path, "--device-memory", "80GiB", "--stage-declarations", "0=mimo-audio")
    assert result.returncode == EXIT_BAD_INPUT
    assert "stages[stage_id=0].max_num_seqs = None" in result.stderr
    # Without declarations the stage plans with vLLM's default utilization, 0.92.
    ok = run("plan", "--deploy", path, "--device-memory", "80GiB", "--json")
    assert json.loads(ok.stdout)["devices"][0]["requested_bytes"] == int(80 * GiB * 0.92)


def test_fixed_part_that_does_not_fit_starves_every_declaring_stage(two_declaring):
    """4 GiB: vLLM-Omni admits it exactly (2 x 1 GiB + 2 GiB = 4 GiB), and
    nothing is left for the 512 MiB fixed part."""
    path, s0, s1 = two_declaring
    declarations = {0: StageDeclarations(0, "s0", load_spec_file(s0)),
                    1: StageDeclarations(1, "s1", load_spec_file(s1))}
    plan = plan_deploy(load_deploy(path), {0: 4 * GiB}, declarations)
    device = plan.devices[0]
    assert device.admission_fits and device.required_bytes == 4 * GiB
    assert device.left_for_per_seq_bytes == -512 * MiB
    assert [s.safe_max_num_seqs for s in plan.stages] == [0, 0]
    assert [s.decision for s in plan.stages] == [Decision.INFEASIBLE, Decision.INFEASIBLE]
    assert not device.fits and plan.infeasible


def test_nested_layout_extras_and_yaml_floats(tmp_path):
    """``engine_args:`` wins over a flat key, ``runtime:`` carries devices,
    an explicit ``engine_extras`` entry wins over a stage field (vLLM-Omni
    applies the extras last), ``kv_cache_memory_bytes: 0`` is unset (the
    worker tests it for truth), and ``1e-1`` is a float as in OmegaConf."""
    path = write_yaml(tmp_path, """
data_parallel_size: 1
stages:
  - stage_id: 0
    max_num_seqs: 4
    gpu_memory_utilization: 0.5
    engine_args: {max_num_seqs: 8, gpu_memory_utilization: 1e-1, kv_cache_memory_bytes: 0}
    runtime: {devices: "1"}
  - stage_id: 1
    devices: "1"
    enforce_eager: false
    engine_extras: {enforce_eager: true}
""")
    stage0, stage1 = load_deploy(path).stages
    assert (stage0.max_num_seqs, stage0.gpu_memory_utilization, stage0.replicas) == (8, 0.1, [[1]])
    assert stage0.max_num_seqs_source == "stages[stage_id=0].engine_args.max_num_seqs"
    assert stage0.kv_cache_memory_bytes is None
    assert stage1.enforce_eager is True and not stage1.captures_cuda_graphs
    assert stage1.gpu_memory_utilization == 0.92  # vLLM 0.30's default


def test_an_operators_headroom_stands_for_every_device(tmp_path):
    """``--headroom-bytes`` with ``--deploy`` plans as a deployment started
    with ``--model-local-kv-headroom`` does: the stages on a device split the
    operator's room, vLLM-Omni's admission terms are not counted again."""
    path = write_yaml(tmp_path, "stages:\n  - {stage_id: 0, devices: '0', max_num_seqs: 64}\n"
                                "  - {stage_id: 1, devices: '0', max_num_seqs: 256}\n")
    per_seq = 2 * 2_326_528  # the preset's request cache and its working copy, one row each
    result = run("plan", "--deploy", path, "--headroom-bytes", "64MiB", "--json",
                 "--stage-declarations", "1=qwen3-tts-async-chunk")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    (device,) = plan["devices"]
    assert device["headroom_bytes"] == 64 * MiB and device["capacity_bytes"] is None
    stages = {s["stage_id"]: s for s in plan["stages"]}
    assert stages[1]["per_seq_bytes"] == per_seq
    assert stages[1]["effective_max_num_seqs"] == 64 * MiB // per_seq
    assert stages[0]["effective_max_num_seqs"] == 64
    table = run("plan", "--deploy", path, "--headroom-bytes", "64MiB", "--stage-declarations", "1=qwen3-tts-async-chunk")
    assert "device 0: headroom 67,108,864 B" in table.stdout and "Traceback" not in table.stderr
