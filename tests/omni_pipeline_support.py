"""What the ``omni_pipeline`` test modules share: a deploy file and one
pipeline run of tests/omni_pipeline_run.py, read back.

Each module starts its pipeline once (a module fixture) and every test reads
what the run produced: the driver's result, its whole log (the stages'
engine cores log into it), each stage's kv-budget report, the observation
probe's record of what kv-budget saw inside each stage, and what the demo
talker really held; :func:`plan_deploy_prints` asks ``kv-budget plan
--deploy`` about the same deploy file. Nothing here imports vLLM or
vLLM-Omni.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from engine_support import metrics_when

from kv_budget.cli import main as kv_budget_main
from kv_budget_demo.serving import ApiServer

RUNNER = Path(__file__).with_name("omni_pipeline_run.py")
SERVE_RUNNER = Path(__file__).with_name("omni_serve_run.py")
MAX_NUM_SEQS = 256
STAGE_INIT_TIMEOUT = 240
"""Seconds vLLM-Omni waits for one stage to become ready (a stage starts in
about 15 s here, the first one of a run in about 35 s)."""


@dataclass
class OmniApiServer(ApiServer):
    """``vllm serve MODEL --omni`` through vLLM-Omni's CLI (tests/omni_serve_run.py)."""

    deploy: str = ""

    def command(self) -> list[str]:
        return [sys.executable, str(SERVE_RUNNER), "serve", self.model, "--omni",
                "--deploy-config", self.deploy, "--host", "127.0.0.1", "--port", str(self.port),
                "--stage-init-timeout", str(STAGE_INIT_TIMEOUT), *self.extra_args]

    def metrics_once_idle(self, completed: dict[int, int]) -> str:
        """The ``/metrics`` body once it shows, for each stage in ``completed``,
        the sample that stage took as its load drained: that many requests
        completed and none held.

        A stage samples once more as it goes idle, possibly after the last
        response went out, and that sample can still move its live limit and
        its share; the API server publishes it within a second. Read earlier,
        ``/metrics`` and the status files a stage leaves would describe two
        different samples."""
        def idle(body: str) -> bool:
            return all((stage_series(body, "kv_budget:live_completed_requests", stage_id),
                        stage_series(body, "kv_budget:live_held_sequences", stage_id)) == (count, 0)
                       for stage_id, count in completed.items())
        return metrics_when(self.url, idle, f"each stage's drain sample (completed {completed}, none held)")


def stage_series(metrics: str, name: str, stage_id: int) -> float | None:
    """The value of ``name`` for stage ``stage_id``, replica 0, in a ``/metrics`` body; None where absent."""
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", metrics, re.M):
        if f'stage="{stage_id}"' in labels and 'replica="0"' in labels:
            return float(value)
    return None


def stage(stage_id: int, max_tokens: int, **settings) -> dict:
    """One stage of a deploy file: device 0, eager (the demo's talker runs in
    Python), ``max_tokens`` per request, ``settings`` added as given."""
    return {
        "stage_id": stage_id,
        "devices": "0",
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": 256,
        "enforce_eager": True,
        "default_sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
        **settings,
    }


@dataclass
class PipelineRun:
    returncode: int
    output: str
    result: dict | None
    reports: dict[str, dict]
    """Report files by name, as the stages wrote them."""
    probes: list[dict]
    """What kv-budget saw in each process that planned, by stage id."""
    stats: list[dict]
    status: dict[str, dict]
    """The stages' status files by name."""
    refused: dict | None
    """The exception ``Omni(...)`` raised (type, message); None when it started."""
    work: Path
    """The run's directory: its deploy file (``deploy.yaml``), reports, stats."""

    def failure(self) -> str:
        """The first error a process of the run logged (an engine core's
        traceback is the root cause a driver's "EngineCore encountered an
        issue" points above to), then the end of the output."""
        lines = self.output.splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line
                      or " ERROR " in line), None)
        head = "\n".join(lines[first:first + 40]) + "\n...\n" if first is not None else ""
        return head + self.output[-3000:]


def write_deploy(work: Path, pipeline: str, stages: list[dict] | int, max_tokens: int) -> Path:
    """A deploy file naming ``pipeline`` with ``stages`` (or that many
    default :func:`stage` entries); returns its path."""
    if isinstance(stages, int):
        stages = [stage(i, max_tokens) for i in range(stages)]
    deploy = work / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"pipeline": pipeline, "async_chunk": False, "stages": stages}, sort_keys=False))
    return deploy


def run_pipeline(work: Path, pipeline: str, stages: list[dict], omni_kwargs: dict, requests: int,
                 max_tokens: int, load_plugins_first: bool = True, checkpoint: Path | None = None) -> PipelineRun:
    """Write the demo checkpoint (unless given) and a deploy file naming
    ``pipeline`` with ``stages``, then start ``Omni(**omni_kwargs)``, serve
    ``requests`` and close the pipeline in its own process."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    checkpoint = checkpoint or write_demo_checkpoint(work / "checkpoint")
    deploy = write_deploy(work, pipeline, stages, max_tokens)
    dirs = {name: work / name for name in ("stats", "status", "probe", "reports")}
    for directory in dirs.values():
        directory.mkdir(exist_ok=True)
    spec = {
        "model": str(checkpoint),
        "deploy": str(deploy),
        "stats_dir": str(dirs["stats"]),
        "status_dir": str(dirs["status"]),
        "probe_dir": str(dirs["probe"]),
        "omni_kwargs": omni_kwargs,
        "load_plugins_first": load_plugins_first,
        "requests": requests,
        "max_tokens": max_tokens,
        "stage_init_timeout": STAGE_INIT_TIMEOUT,
    }
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=900)
    output = proc.stdout + proc.stderr
    (work / "pipeline.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED ")]
    probes = sorted((json.loads(p.read_text()) for p in dirs["probe"].glob("plan-*.json")),
                    key=lambda probe: str(probe["stage_id"]))
    return PipelineRun(
        returncode=proc.returncode,
        output=output,
        result=json.loads(lines[-1][len("RESULT "):]) if lines else None,
        reports={p.name: json.loads(p.read_text()) for p in sorted(dirs["reports"].glob("*.json"))},
        probes=probes,
        stats=[json.loads(p.read_text()) for p in sorted(dirs["stats"].rglob("stats-rank*.json"))],
        status={p.name: json.loads(p.read_text()) for p in sorted(dirs["status"].glob("engine-*.json"))},
        refused=json.loads(refused[-1][len("REFUSED "):]) if refused else None,
        work=work,
    )


DECLARATION_KEYS = ("owner", "name", "layers", "kv_heads", "head_dim", "dtype", "physical_capacity_positions",
                    "capacity_source", "scope", "rows", "rows_fixed", "rows_reason")
"""A report's declaration line fields that a spec file takes (the figures
after the operator's overrides)."""


def plan_deploy_prints(work: Path, reports: dict[str, dict], device_memory: str) -> dict[int, int]:
    """Each stage's ``max_num_seqs`` as ``kv-budget plan --deploy`` prints it
    for the run's deploy file and ``device_memory``, with each stage's
    declarations as its report lists them, written to a spec file."""
    args = ["plan", "--deploy", str(work / "deploy.yaml"), "--device-memory", device_memory, "--json"]
    for name, report in sorted(reports.items()):
        sid = report["stage"]["stage_id"]
        spec = work / f"stage{sid}-declarations.json"
        spec.write_text(json.dumps([{k: d[k] for k in DECLARATION_KEYS if d.get(k) is not None}
                                    for d in report["declarations"]]))
        args += ["--stage-declarations", f"{sid}={spec}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = kv_budget_main(args)
    assert code == 0, out.getvalue()
    return {s["stage_id"]: s["effective_max_num_seqs"] for s in json.loads(out.getvalue())["stages"]}
