"""The spec file and the deploy file, fuzzed: whatever they hold,
``kv-budget plan`` ends with a plan (exit 0), an infeasible plan (exit 3) or
one line naming what is wrong (exit 2); never a traceback.

In process (a console-script start imports torch: seconds per example).
Generated inputs are arbitrary text, arbitrary JSON/YAML values, and a valid
file with one value replaced by an arbitrary one or one key dropped, which
is where real mistakes are."""

from __future__ import annotations

import contextlib
import io
import json
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_budget.cli import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)

VALID_SPEC = {
    "name": "kv", "owner": "talker", "layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float16",
    "physical_capacity_positions": 100, "capacity_source": "config", "scope": "request", "rows": "max_num_seqs",
}
VALID_STAGE = {"stage_id": 0, "devices": "0", "gpu_memory_utilization": 0.5, "engine_args": {"max_num_seqs": 8}}


def plan(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["plan", *args])
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, err.getvalue()


def assert_clean_end(code: int, stderr: str) -> None:
    assert code in (EXIT_OK, EXIT_INFEASIBLE, EXIT_BAD_INPUT), (code, stderr)
    assert "Traceback" not in stderr
    if code == EXIT_BAD_INPUT:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kv-budget plan: error: "), stderr


def _json_text(value) -> str:
    return json.dumps(value, allow_nan=True)


def mutated(valid: dict, keys: list[str]):
    """``valid`` with one key set to an arbitrary value, or dropped."""
    return st.tuples(st.sampled_from(keys), st.one_of(values, st.just(KeyError))).map(
        lambda change: {k: v for k, v in {**valid, change[0]: change[1]}.items() if v is not KeyError})


spec_texts = st.one_of(
    st.text(max_size=60),
    values.map(_json_text),
    st.lists(mutated(VALID_SPEC, list(VALID_SPEC) + ["rows_fixed", "rows_reason", "extra"]), min_size=1,
             max_size=2).map(_json_text),
)


@FUZZ
@given(text=spec_texts)
def test_any_spec_file_ends_in_a_plan_or_one_line(tmp_path, text):
    path = tmp_path / "spec.json"
    path.write_text(text)
    assert_clean_end(*plan("--spec-file", str(path), "--headroom-bytes", "1GiB"))


def _yaml_text(value) -> str:
    def plain(v):  # YAML has no NaN literal that round-trips as a mistake; keep the float
        return v if not (isinstance(v, float) and math.isnan(v)) else ".nan"
    return yaml.safe_dump(value, default_flow_style=True) if not isinstance(value, float) else str(plain(value))


stage_keys = list(VALID_STAGE) + ["num_replicas", "kv_cache_memory_bytes", "base_config"]
deploy_texts = st.one_of(
    st.text(max_size=60),
    values.map(_yaml_text),
    st.lists(mutated(VALID_STAGE, stage_keys), min_size=1, max_size=2).map(lambda stages: _yaml_text({"stages": stages})),
    mutated(VALID_STAGE["engine_args"], ["max_num_seqs", "gpu_memory_utilization", "max_model_len"]).map(
        lambda args: _yaml_text({"stages": [{**VALID_STAGE, "engine_args": args}]})),
)


@FUZZ
@given(text=deploy_texts)
def test_any_deploy_file_ends_in_a_plan_or_one_line(tmp_path, text):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    assert_clean_end(*plan("--deploy", str(path), "--device-memory", "80GiB"))
