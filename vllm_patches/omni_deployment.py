"""vLLM-Omni: the driver records the deployment its stages split (:func:`record_deployment`).

vLLM-Omni's orchestrator resolves every stage (its devices, its
``gpu_memory_utilization``, graph capture, pool size, ``max_num_seqs``) in
the driver process before it spawns one: in
``StageRuntime._build_logical_stage_init_plans``, which
:func:`vllm_patches.omni.patch_stage_runtime` wraps. From the plans it
returns, this module writes the deployment's record
(:mod:`kv_budget.deployment`) and names it to the stages through
:data:`~kv_budget.deployment.DEPLOYMENT_ENV`, which every stage process
inherits. Each figure is the one vLLM-Omni's own admission check reads
(``engine/stage_admission.py``: the replica's ``stage_vllm_config``, its
``graph_reserve_bytes``, the physical devices its runtime config resolves
to).

A device's size comes from the operator's ``device_memory_bytes`` where
given, else from NVML on CUDA. Where neither is known (vLLM's CPU build) and
no headroom is given for the device, there is nothing to split: one line
says so, and the stages plan against their own headroom and the device
ledger, as engines outside a deployment do.
"""

from __future__ import annotations

import atexit
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from kv_budget.deployment import (
    DEPLOYMENT_ENV,
    DeploymentError,
    DeploymentRecord,
    create_deployment,
    deployment_path,
    read_deployment,
    split_max_num_seqs,
)
from kv_budget.ledger import default_ledger_dir, this_process
from kv_budget.log import logger
from kv_budget.plan.deploy_file import StageDeploy
from kv_budget.sample.device import MemorySamplingError, sample_memory
from kv_budget.settings import LEDGER_OFF, ModelLocalKVSettings, Policy, settings_from_additional_config
from kv_budget.stage import Stage
from kv_budget.units import format_bytes
from vllm_patches.engine import lower_max_num_seqs


__all__ = ["lower_driver_copies", "record_deployment"]

PLANNING_POLICIES = (Policy.CAP, Policy.WARN)
"""Stages under these plan max_num_seqs, so record themselves; ``reserve``
holds its model-local KV inside its pool share and ``off`` does nothing."""


def _physical_devices(replica: Any, visible: str | None) -> list[int] | None:
    """The replica's physical device ids, resolved as vLLM-Omni's admission
    resolves them; None for devices it cannot name (``cpu``, UUIDs)."""
    from vllm_omni.engine.stage_init_utils import parse_physical_device_ids
    from vllm_omni.entrypoints.stage_utils import resolve_stage_physical_devices

    runtime = replica.metadata.runtime_cfg or {}
    devices = runtime.get("devices") if hasattr(runtime, "get") else getattr(runtime, "devices", None)
    parsed = parse_physical_device_ids(resolve_stage_physical_devices(
        replica.metadata.stage_id, devices, visible_baseline=visible))
    return sorted(parsed) if parsed else None


def _stage_deploy(plan: Any, visible: str | None) -> tuple[StageDeploy, ModelLocalKVSettings | None] | None:
    """One logical stage as vLLM-Omni resolved it, and its settings (None
    for a diffusion stage, which gets none); None when a replica's devices
    cannot be named."""
    from vllm_omni.engine.stage_admission import _diffusion_utilization, graph_reserve_bytes

    replicas = []
    for replica in plan.replicas:
        devices = _physical_devices(replica, visible)
        if devices is None:
            return None
        replicas.append(devices)
    first = plan.replicas[0]
    config = first.stage_vllm_config
    where = f"stage {plan.stage_id} as vLLM-Omni resolved it"
    if config is None:  # a diffusion stage: no engine config before launch
        util = _diffusion_utilization(first)
        return StageDeploy(
            stage_id=plan.stage_id, replicas=replicas, devices_source=f"{where}: runtime devices",
            gpu_memory_utilization=float(util if util is not None else 0.0),
            gpu_memory_utilization_source=f"{where}: diffusion stage_cfg", max_num_seqs=None,
            max_num_seqs_source="diffusion stage", enforce_eager=True, cudagraph_mode=None,
            captures_cuda_graphs=False, graph_reserve_source="diffusion stage: no graph reserve in vLLM-Omni",
            kv_cache_memory_bytes=None), None
    graph = graph_reserve_bytes(config)
    pool = getattr(config.cache_config, "kv_cache_memory_bytes", None) or None
    mode = getattr(config.compilation_config, "cudagraph_mode", None)
    return StageDeploy(
        stage_id=plan.stage_id, replicas=replicas, devices_source=f"{where}: runtime devices",
        gpu_memory_utilization=float(config.cache_config.gpu_memory_utilization),
        gpu_memory_utilization_source=f"{where}: cache_config.gpu_memory_utilization",
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_seqs_source=f"{where}: scheduler_config.max_num_seqs",
        enforce_eager=bool(config.model_config.enforce_eager), cudagraph_mode=None if mode is None else str(mode),
        captures_cuda_graphs=graph > 0,
        graph_reserve_source=f"vLLM-Omni's graph_reserve_bytes(): {graph:,} B",
        kv_cache_memory_bytes=pool,
        kv_cache_memory_bytes_source=None if pool is None else f"{where}: cache_config.kv_cache_memory_bytes",
    ), settings_from_additional_config(config.additional_config)


def _one_value(device: int, given: dict[int, int | None], what: str, key: str) -> int | None:
    """The one value the stages on ``device`` give for ``key``; ValueError
    when they differ (each is the device's, not a stage's)."""
    values = {sid: value for sid, value in given.items() if value is not None}
    if len(set(values.values())) > 1:
        named = ", ".join(f"stage {sid}: {value:,} B" for sid, value in sorted(values.items()))
        raise ValueError(
            f"kv-budget: the stages on device {device} give different {what} ({named}); it is the device's "
            f"figure, which its stages split: give one {key} to all of them (a deployment-wide setting)")
    return next(iter(values.values()), None)


def _capacity(device: int, visible: str | None) -> tuple[int, str] | None:
    """A CUDA device's total memory from NVML; None where it cannot be measured."""
    from vllm_omni.platforms import current_omni_platform

    if getattr(current_omni_platform, "device_type", None) != "cuda":
        return None
    ordinal = device
    if visible:
        tokens = [t.strip() for t in visible.split(",")]
        ordinal = tokens.index(str(device)) if str(device) in tokens else device
    try:
        sample = sample_memory("cuda", ordinal)
    except MemorySamplingError:
        return None
    return sample.total_bytes, f"{sample.source}: total"


def _device_figures(stages: list[StageDeploy], settings: dict[int, ModelLocalKVSettings], visible: str | None,
                    ) -> tuple[dict[int, int], dict[int, str], dict[int, tuple[int, str]]] | None:
    """Per device the deployment's stages use: its size and where it came
    from, and the operator's headroom where given; None (logged) where a
    device has neither a size nor a headroom. ValueError where the stages on
    a device give it different ones."""
    from vllm_omni.platforms import current_omni_platform

    capacities, sources, headrooms, unknown = {}, {}, {}, []
    for device in sorted({d for s in stages for d in s.devices}):
        here = {s.stage_id: settings[s.stage_id] for s in stages if device in s.devices and s.stage_id in settings}
        size = _one_value(device, {sid: c.device_memory_bytes for sid, c in here.items()}, "device sizes",
                          "device_memory_bytes (--model-local-kv-device-memory)")
        headroom = _one_value(device, {sid: c.headroom_bytes for sid, c in here.items()
                                       if c.policy in PLANNING_POLICIES},
                              "headrooms", "headroom_bytes (--model-local-kv-headroom)")
        if headroom is not None:
            headrooms[device] = (headroom, "--model-local-kv-headroom (the operator's room outside the pools)")
        if size is not None:
            capacities[device], sources[device] = size, "--model-local-kv-device-memory"
        elif (measured := _capacity(device, visible)) is not None:
            capacities[device], sources[device] = measured
        elif headroom is None:
            unknown.append(device)
    if unknown:
        logger.info(
            "the size of device(s) %s cannot be measured on this platform (%s) and no headroom is "
            "given: the deployment is not split, and a stage that plans before the others on a device can count "
            "memory they will take. Give --model-local-kv-device-memory SIZE (or model_local_kv.device_memory_bytes)",
            unknown, getattr(current_omni_platform, "device_type", "?"))
        return None
    return capacities, sources, headrooms


def record_deployment(stage_plans: Any) -> Path | None:
    """Write the record of the deployment ``stage_plans`` describe (each
    ``LogicalStageInitPlan`` of vLLM-Omni) and set
    :data:`~kv_budget.deployment.DEPLOYMENT_ENV` to it; return its path, or
    None when no stage plans or a device has neither a size nor a headroom
    (logged). ValueError when the stages on a device give it different sizes
    or headrooms."""
    from vllm_omni.platforms import current_omni_platform

    os.environ.pop(DEPLOYMENT_ENV, None)
    visible = os.environ.get(current_omni_platform.device_control_env_var)
    stages: list[StageDeploy] = []
    settings: dict[int, ModelLocalKVSettings] = {}
    for plan in stage_plans:
        resolved = _stage_deploy(plan, visible)
        if resolved is None:
            logger.info("stage %s's devices are not device indices: the deployment is not split; its "
                        "stages plan against their own headroom and the device ledger", plan.stage_id)
            return None
        stages.append(resolved[0])
        if resolved[1] is not None:
            settings[plan.stage_id] = resolved[1]
    planning = [Stage(stage_id=s.stage_id, replica=r) for s in stages for r in range(len(s.replicas))
                if s.stage_id in settings and settings[s.stage_id].policy in PLANNING_POLICIES]
    if not planning:
        return None
    measured = _device_figures(stages, settings, visible)
    if measured is None:
        return None
    capacities, sources, headrooms = measured
    chosen = next((c for c in settings.values() if c.ledger_dir and c.ledger_dir != LEDGER_OFF), None)
    ledger, shared = (chosen.ledger_dir, chosen.ledger_shared) if chosen is not None else (None, False)
    pid, start = this_process()
    record = DeploymentRecord(driver_pid=pid, driver_start=start, stages=stages, planning=planning,
                              capacities=capacities, capacity_sources=sources, headrooms=headrooms)
    try:
        path = create_deployment(deployment_path(Path(ledger) if ledger else default_ledger_dir()), record, shared)
    except DeploymentError as exc:
        logger.warning("%s; the deployment is not split", exc)
        return None
    atexit.register(_remove, path)
    os.environ[DEPLOYMENT_ENV] = str(path)
    figures = "; ".join(
        f"device {d}: " + (f"capacity {format_bytes(capacities[d])} [{sources[d]}]" if d in capacities else
                           f"headroom {format_bytes(headrooms[d][0])} [{headrooms[d][1]}]")
        for d in sorted(set(capacities) | set(headrooms)))
    logger.info("deployment of %d stage(s) recorded in %s for its stages to split (%s); planning: %s",
                len(stages), path, figures, ", ".join(s.label() for s in planning))
    return path


def lower_driver_copies(stage_plans: Any) -> None:
    """Once every stage is ready (``StageRuntime._finalize_initialized_stages``):
    the driver's copy of each capped stage's ``max_num_seqs`` (the
    ``stage_vllm_config`` its client holds) down to the stage's final split.
    A stage that planned before the others answered ready with its
    provisional value, which :mod:`vllm_patches.frontend` copied; the
    engine core applies the final one before its first request."""

    path = os.environ.get(DEPLOYMENT_ENV)
    if not path:
        return
    try:
        record = read_deployment(Path(path))
    except DeploymentError:
        return  # the stages logged it when they planned
    for plan in stage_plans:
        for replica in plan.replicas:
            stage = Stage(stage_id=plan.stage_id, replica=replica.replica_id)
            entry = next((e for e in record.planned if e.stage == stage), None)
            if entry is None or entry.policy != Policy.CAP.value or replica.stage_vllm_config is None:
                continue
            applied = lower_max_num_seqs(replica.stage_vllm_config.scheduler_config,
                                         split_max_num_seqs(record, stage))
            if applied:
                logger.info("driver's copy of %s's config: %s (its final deployment split)",
                            stage.label(), "; ".join(applied))


def _remove(path: Path) -> None:
    for leftover in (path, path.with_suffix(".lock")):
        with suppress(OSError):
            leftover.unlink()
