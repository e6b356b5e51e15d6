"""`kv-budget plan` and `kv-budget audit`: presets, spec files, headroom
options, exit codes.

Most tests call :func:`kv_budget.cli.main`, the console script's entry
point, in this process (a fresh process imports torch: seconds per test). A
few run the installed console script itself, as a user would: its exit code,
its stdout and stderr, and an audit target resolved from its working
directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kv_budget.cli import EXIT_AUDIT_FAILED, EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main
from kv_budget.units import GiB, MiB

SCRIPT = shutil.which("kv-budget", path=str(Path(sys.executable).parent))
REPO = Path(__file__).resolve().parents[1]


def run_script(*args):
    """Through the installed console script, in a fresh process, from the repository."""
    assert SCRIPT, "the kv-budget console script is not installed in this environment"
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run(capsys, *args) -> Result:
    """``kv-budget ARGS`` in this process: what the console script would exit
    with (``main``'s return value, or the code of argparse's SystemExit) and
    print."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return Result(code, out, err)


def plan_json(capsys, *args):
    result = run(capsys, "plan", "--json", *args)
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


@pytest.fixture
def in_repo(monkeypatch):
    """The console script's working directory, the repository: audit targets
    (``tests.audit_models:...``) resolve from it. ``audit`` puts it on
    ``sys.path``, which is put back afterwards."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_preset_capped_json_has_the_documented_keys():
    result = run_script("plan", "--json", "--preset", "qwen3-tts-async-chunk", "--headroom-bytes", "1GiB")
    assert result.returncode == EXIT_OK
    plan = json.loads(result.stdout)
    for key in ("safe_max_num_seqs", "effective_max_num_seqs", "per_seq_bytes", "charged_bytes",
                "uncharged_fixed_bytes", "headroom_bytes", "decision", "declarations"):
        assert key in plan
    assert plan["per_seq_bytes"] == 2 * 2_326_528  # two bfloat16 rows of 71 positions
    assert plan["charged_bytes"] == 11_632_640
    assert plan["headroom_bytes"] == GiB
    assert plan["effective_max_num_seqs"] == GiB // (2 * 2_326_528)
    assert plan["decision"] == "capped"


def test_explicit_headroom_takes_no_margin_and_device_memory_does(capsys):
    _, explicit = plan_json(capsys, "--preset", "mimo-audio", "--headroom-bytes", "512MiB")
    assert explicit["headroom_bytes"] == 512 * MiB and explicit["margin_bytes"] == 0
    _, derived = plan_json(capsys, "--preset", "mimo-audio", "--device-memory", "80GiB",
                           "--gpu-memory-utilization", "0.9")
    assert derived["margin_bytes"] == 4 * GiB
    assert derived["headroom_bytes"] == 8 * GiB - 4 * GiB
    _, margin = plan_json(capsys, "--preset", "mimo-audio", "--device-memory", "80GiB", "--margin-bytes", "1GiB")
    assert margin["headroom_bytes"] == 8 * GiB - GiB


def test_warn_keeps_max_num_seqs_and_exits_zero(capsys):
    result, plan = plan_json(capsys, "--preset", "qwen3-tts-async-chunk", "--headroom-bytes", "512MiB",
                             "--policy", "warn", "--max-num-seqs", "200")
    assert result.returncode == EXIT_OK
    assert plan["decision"] == "warned" and plan["effective_max_num_seqs"] == 200


def test_infeasible_under_cap_exits_3_with_one_line():
    result = run_script("plan", "--preset", "minicpm-o-streaming", "--headroom-bytes", "100MiB")
    assert result.returncode == EXIT_INFEASIBLE
    assert "Traceback" not in result.stderr
    assert "147,456,000 B" in result.stderr and "104,857,600 B" in result.stderr
    assert "thinker.apm/whisper_encoder_self_attn" in result.stderr


def test_table_output_names_figures_and_sources(capsys):
    result = run(capsys, "plan", "--preset", "ming-talker", "--headroom-bytes", "1GiB")
    assert result.returncode == EXIT_OK
    assert "25,165,824 B (24.00 MiB)" in result.stdout
    assert "--headroom-bytes (operator override)" in result.stdout


def test_list_presets_shows_each_correction_with_its_reason(capsys):
    result = run(capsys, "plan", "--list-presets")
    assert "--override thinker.apm/whisper_encoder_self_attn:rows_fixed=4" in result.stdout
    assert "max_sessions 4" in result.stdout


def test_list_presets(capsys):
    result = run(capsys, "plan", "--list-presets")
    assert result.returncode == EXIT_OK
    assert {line.split(":")[0] for line in result.stdout.splitlines() if not line.startswith(" ")} == {
        "qwen3-tts-async-chunk", "mimo-audio", "minicpm-o-streaming", "ming-talker"}


def test_spec_file_round_trip(capsys, tmp_path):
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([
        {"owner": "talker", "name": "kv", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16",
         "physical_capacity_positions": 100, "capacity_source": "window", "scope": "request",
         "rows": "max_num_seqs"},
        {"name": "pool", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "torch.float32",
         "physical_capacity_positions": 100, "capacity_source": "window", "scope": "session",
         "rows": "fixed", "rows_fixed": 2, "rows_reason": "two sessions"},
    ]))
    result, plan = plan_json(capsys, "--spec-file", str(path), "--headroom-bytes", "10MiB", "--max-num-seqs", "64")
    assert result.returncode == EXIT_OK
    per_seq = 2 * 2 * 2 * 64 * 100 * 2
    fixed = 2 * (2 * 2 * 2 * 64 * 100 * 4)
    assert plan["per_seq_bytes"] == per_seq and plan["uncharged_fixed_bytes"] == fixed
    assert plan["safe_max_num_seqs"] == (10 * MiB - fixed) // per_seq
    assert plan["declarations"][0]["owner"] == "talker"


BAD_SPEC_ENTRIES = [
    ("not json", "not JSON"),
    ("{}", "expected a JSON list"),
    ("[1]", "expected an object"),
    ('[{"name": "kv"}]', "missing required key"),
    ('[{"name": "kv", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "bf16", '
     '"physical_capacity_positions": 1, "capacity_source": "x", "scope": "request", "rows": "max_num_seqs"}]',
     "not a torch dtype"),
    ('[{"name": "kv", "layers": 0, "kv_heads": 2, "head_dim": 64, "dtype": "float16", '
     '"physical_capacity_positions": 1, "capacity_source": "x", "scope": "request", "rows": "max_num_seqs"}]',
     "'layers' = 0"),
    ('[{"name": "kv", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float16", "rows_fixd": 3, '
     '"physical_capacity_positions": 1, "capacity_source": "x", "scope": "request", "rows": "max_num_seqs"}]',
     "unknown key"),
    ('[{"name": "kv", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float16", "owner": 3, '
     '"physical_capacity_positions": 1, "capacity_source": "x", "scope": "request", "rows": "max_num_seqs"}]',
     "'owner' must be a string"),
]


@pytest.mark.parametrize("content, expected", BAD_SPEC_ENTRIES)
def test_bad_spec_files_exit_2_with_a_message(capsys, tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = run(capsys, "plan", "--spec-file", str(path), "--headroom-bytes", "1GiB")
    assert result.returncode == EXIT_BAD_INPUT
    assert expected in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--preset", "ming-talker"], "--headroom-bytes SIZE or --device-memory"),
        (["--headroom-bytes", "1GiB"], "--spec-file FILE or --preset"),
        (["--preset", "nope", "--headroom-bytes", "1GiB"], "invalid choice"),
        (["--preset", "ming-talker", "--headroom-bytes", "12 parsecs"], "unknown unit"),
        (["--preset", "ming-talker", "--headroom-bytes", "-5"], "not a byte size"),
        (["--preset", "ming-talker", "--headroom-bytes", "1.5"], "whole number of bytes"),
        (["--preset", "ming-talker", "--headroom-bytes", "1GiB", "--device-memory", "8GiB"], "not allowed with"),
        (["--preset", "ming-talker", "--headroom-bytes", "1GiB", "--margin-bytes", "1MiB"], "used as given"),
        (["--preset", "ming-talker", "--device-memory", "eighty"], "not a byte size"),
        (["--preset", "ming-talker", "--device-memory", "8GiB", "--margin-bytes", "1.5B"], "whole number of bytes"),
        (["--preset", "ming-talker", "--device-memory", "8GiB", "--gpu-memory-utilization", "1.2"], "not in (0, 1]"),
        (["--preset", "ming-talker", "--device-memory", "8GiB", "--gpu-memory-utilization", "0"], "not in (0, 1]"),
        (["--list-presets", "--preset", "ming-talker"], "not allowed with"),
        (["--preset", "ming-talker", "--device-memory", "8GiB", "--gpu-memory-utilization", "x"], "not a number"),
        (["--preset", "ming-talker", "--headroom-bytes", "1GiB", "--max-num-seqs", "0"], "must be >= 1"),
        (["--preset", "ming-talker", "--headroom-bytes", "1GiB", "--max-num-seqs", "many"], "not an integer"),
        (["--preset", "ming-talker", "--headroom-bytes", "1GiB", "--policy", "maybe"], "invalid choice"),
        (["--spec-file", "/nonexistent.json", "--headroom-bytes", "1GiB"], "cannot read"),
        (["--preset", "ming-talker", "--spec-file", "x.json", "--headroom-bytes", "1GiB"], "not allowed with"),
    ],
)
def test_bad_options_exit_2_with_a_message(capsys, args, expected):
    result = run(capsys, "plan", *args)
    assert result.returncode == EXIT_BAD_INPUT
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_audit_of_a_matching_model_exits_0_with_exact_bytes():
    # The console script: its sys.path holds its bin directory, not the
    # repository, so only a fresh process shows MODULE resolved from the
    # working directory (under pytest the repository is on sys.path already).
    result = run_script("audit", "tests.audit_models:build_ming_omni")
    assert result.returncode == EXIT_OK, result.stderr
    assert "25,165,824 B" in result.stdout and "match" in result.stdout


def test_audit_of_an_under_declared_model_exits_4(capsys, in_repo):
    result = run(capsys, "audit", "tests.audit_models:build_sliding_declared_window_minus_one", "--json")
    assert result.returncode == EXIT_AUDIT_FAILED
    report = json.loads(result.stdout)
    assert report["failed"] is True
    (owner,) = report["owners"]
    assert owner["verdict"] == "under-declared"
    assert owner["measured_bytes"] > owner["declared_bytes"]


@pytest.mark.parametrize(
    "target, expected",
    [
        ("no_colon_here", "one ':'"),
        ("tests.audit_models:returns_none", "returned None"),
        ("tests.audit_models:NOT_CALLABLE", "not callable"),
        ("kv_budget_nonexistent_module:build", "cannot import"),
    ],
)
def test_audit_bad_targets_exit_2(capsys, in_repo, target, expected):
    result = run(capsys, "audit", target)
    assert result.returncode == EXIT_BAD_INPUT
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_override_corrects_a_preset_and_the_plan_shows_both_values(capsys):
    result, plan = plan_json(capsys, "--preset", "qwen3-tts-async-chunk", "--headroom-bytes", "1GiB",
                             "--override", "decoder/codec_decoder_request:physical_capacity_positions=72")
    assert result.returncode == EXIT_OK, result.stderr
    row_72 = 2 * 8 * 16 * 64 * 72 * 2
    assert plan["per_seq_bytes"] == row_72 + 2_326_528
    assert plan["effective_max_num_seqs"] == GiB // (row_72 + 2_326_528)
    (request,) = [d for d in plan["declarations"] if d["name"] == "codec_decoder_request"]
    assert request["overrides"] == [{"field": "physical_capacity_positions", "declared": 71, "applied": 72}]
    table = run(capsys, "plan", "--preset", "qwen3-tts-async-chunk", "--headroom-bytes", "1GiB",
                "--override", "decoder/codec_decoder_request:physical_capacity_positions=72").stdout
    assert "overridden by the operator: physical_capacity_positions declared 71 -> applied 72" in table


def test_override_that_matches_nothing_exits_2_naming_the_declarations(capsys):
    result = run(capsys, "plan", "--preset", "minicpm-o-streaming", "--headroom-bytes", "1GiB",
                 "--override", "apm/whisper_encoder_self_attn:rows_fixed=4")
    assert result.returncode == EXIT_BAD_INPUT
    assert "'apm/whisper_encoder_self_attn:rows_fixed=4' match no declaration" in result.stderr
    assert "declarations: thinker.apm/whisper_encoder_self_attn" in result.stderr
    bad = run(capsys, "plan", "--preset", "minicpm-o-streaming", "--headroom-bytes", "1GiB",
              "--override", "thinker.apm/whisper_encoder_self_attn:rows_fixed=0")
    assert bad.returncode == EXIT_BAD_INPUT and "0 must be >= 1" in bad.stderr


# --- cap and reserve side by side: --kv-pool-bytes ---

POOL_FLAGS = ("--kv-pool-bytes", "40GiB", "--block-bytes", "2MiB", "--max-model-len", "4096")
QWEN3_TTS_PER_SEQ = 2 * 2_326_528  # request row + working copy, bf16


def test_pool_flags_show_cap_and_reserve_side_by_side(capsys):
    result = run(capsys, "plan", "--preset", "qwen3-tts-async-chunk", "--headroom-bytes", "1GiB", *POOL_FLAGS)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    reserved = 256 * QWEN3_TTS_PER_SEQ
    blocks_before, blocks_after = 40 * 1024 // 2, (40 * 1024**3 - reserved) // (2 * 1024**2)
    assert f"cap:     max_num_seqs 256 -> {1024**3 // QWEN3_TTS_PER_SEQ};" in out
    assert (f"reserve: max_num_seqs stays 256; {reserved:,} B come out of the pool: "
            f"{blocks_before:,} -> {blocks_after:,} blocks") in out
    assert "paged pool: 42,949,672,960 B (40960.00 MiB) before (--kv-pool-bytes)" in out


def test_reserve_alone_needs_no_headroom_and_its_json_has_the_pool_figures(capsys):
    result = run(capsys, "plan", "--json", "--preset", "qwen3-tts-async-chunk", "--policy", "reserve", *POOL_FLAGS)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["cap"] is None
    reserve = document["reserve"]
    assert reserve["reserved_bytes"] == 256 * QWEN3_TTS_PER_SEQ
    assert reserve["kv_pool_bytes_after"] == 40 * 1024**3 - reserve["reserved_bytes"]
    assert reserve["blocks_per_sequence"] == 4096 // 16
    assert reserve["max_concurrency_at_max_model_len"] == reserve["num_blocks_after"] / 256


def test_reserve_that_leaves_no_room_for_one_sequence_exits_3(capsys):
    result = run(capsys, "plan", "--preset", "qwen3-tts-async-chunk", "--policy", "reserve",
                 "--kv-pool-bytes", "1GiB", "--block-bytes", "2MiB", "--max-model-len", "4096")
    assert result.returncode == 3
    assert "policy reserve: on rank 0, reserving 1,191,182,336 B of model-local KV" in result.stderr


@pytest.mark.parametrize("args, expected", [
    (("--policy", "reserve", "--headroom-bytes", "1GiB"), "--policy reserve takes model-local KV out of the paged pool"),
    (("--headroom-bytes", "1GiB", "--kv-pool-bytes", "40GiB"), "the pool needs all of --kv-pool-bytes SIZE"),
])
def test_reserve_without_the_pool_is_bad_input(capsys, args, expected):
    result = run(capsys, "plan", "--preset", "qwen3-tts-async-chunk", *args)
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_reserve_does_not_apply_to_a_deploy_file(capsys):
    result = run(capsys, "plan", "--deploy", "qwen3_tts.yaml", "--device-memory", "80GiB", "--policy", "reserve")
    assert result.returncode == 2
    assert "--policy reserve does not apply to --deploy" in result.stderr
