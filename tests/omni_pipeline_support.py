"""What the ``omni_pipeline`` test modules share: a deploy file and one
pipeline run of tests/omni_pipeline_run.py, read back.

Each module starts its pipeline once (a module fixture) and every test reads
what the run produced: the driver's result, its whole log (the stages'
engine cores log into it), each stage's kv-budget report, the observation
probe's record of what kv-budget saw inside each stage, and what the demo
talker really held. Nothing here imports vLLM or vLLM-Omni.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

RUNNER = Path(__file__).with_name("omni_pipeline_run.py")
MAX_NUM_SEQS = 256
STAGE_INIT_TIMEOUT = 240
"""Seconds vLLM-Omni waits for one stage to become ready (a stage starts in
about 15 s here, the first one of a run in about 35 s)."""


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

    def failure(self) -> str:
        return self.output[-4000:]


def run_pipeline(work: Path, pipeline: str, stages: list[dict], model_local_kv: dict, requests: int,
                 max_tokens: int) -> PipelineRun:
    """Write the demo checkpoint and a deploy file naming ``pipeline`` with
    ``stages``, then start, serve ``requests`` and close the pipeline in its
    own process, ``Omni(additional_config={"model_local_kv": model_local_kv})``."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    checkpoint = write_demo_checkpoint(work / "checkpoint")
    deploy = work / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"pipeline": pipeline, "async_chunk": False, "stages": stages}, sort_keys=False))
    dirs = {name: work / name for name in ("stats", "status", "probe", "reports")}
    for directory in dirs.values():
        directory.mkdir()
    spec = {
        "model": str(checkpoint),
        "deploy": str(deploy),
        "stats_dir": str(dirs["stats"]),
        "status_dir": str(dirs["status"]),
        "probe_dir": str(dirs["probe"]),
        "additional_config": {"model_local_kv": model_local_kv},
        "requests": requests,
        "max_tokens": max_tokens,
        "stage_init_timeout": STAGE_INIT_TIMEOUT,
    }
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=900)
    output = proc.stdout + proc.stderr
    (work / "pipeline.log").write_text(output)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    probes = sorted((json.loads(p.read_text()) for p in dirs["probe"].glob("plan-*.json")),
                    key=lambda probe: str(probe["stage_id"]))
    return PipelineRun(
        returncode=proc.returncode,
        output=output,
        result=json.loads(lines[-1][len("RESULT "):]) if lines else None,
        reports={p.name: json.loads(p.read_text()) for p in sorted(dirs["reports"].glob("*.json"))},
        probes=probes,
        stats=[json.loads(p.read_text()) for p in sorted(dirs["stats"].glob("stats-rank*.json"))],
    )
