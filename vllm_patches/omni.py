"""vLLM-Omni: kv-budget in a deployment, configured as its operators configure it.

vLLM-Omni runs one vLLM engine core per stage and replica
(``StageEngineCoreProc``, an ``EngineCoreProc``), so the engine hooks of
this package plan in every LLM stage as they do in plain vLLM. What a
deployment adds is handled here, in the driver process (the API server of
``vllm serve --omni``, or the script that builds ``Omni``/``AsyncOmni``),
where vLLM-Omni's orchestrator resolves the whole deploy:

**Settings reach every stage** (:func:`patch_config_resolution`).
vLLM-Omni passes a stage only its ``additional_config``; it drops keyword
arguments and flags it does not know (``--model-local-kv-*``,
``model_local_kv_policy=...``) without a word, and merges a global
``additional_config`` over every LLM stage's own, so the global value wins.
The wrapper around its one resolver (``VllmOmniConfig.from_pipeline_config``)
takes the deployment-wide settings out of its input (the flags or keywords,
which win per key over a global ``additional_config["model_local_kv"]``),
lets vLLM-Omni resolve the rest, and writes into each LLM stage's
``additional_config`` the deployment-wide settings with the stage's own
(deploy YAML, ``--stage-overrides``) winning per key; overrides add up
(deployment-wide first). Each stage's result is validated there, naming
the stage. A stage that cannot take them (a diffusion stage) is named in a
warning, as is a stage whose deploy-file settings a ``platforms:`` section
replaced on the platform it runs on.

**Stages sharing a device split it** (:mod:`vllm_patches.omni_deployment`).
Once vLLM-Omni has resolved every stage, before it spawns one, the driver
records each stage's placement and sizing for the stages to split each
device by the rule ``kv-budget plan --deploy`` uses, whatever order they
start in (:mod:`kv_budget.deployment`).

**One check across stages** (:func:`patch_stage_runtime`). An override
that names no stage applies in every stage that has its declaration; a
stage that lacks it logs so and starts. Once every stage is up (with one
API server or several), the driver reads each stage's status file and
stops the deployment when such an override matched in no stage, naming
every stage's declarations.

**Metrics** are the frontend's
(:func:`vllm_patches.frontend.patch_omni_stat_logger`): registration
patches vLLM-Omni's stat logger where :func:`register_omni` reports that
vLLM-Omni runs.

In the stage itself, :func:`stage_of` is the stage id and replica every
status file, report, ledger entry and log line carries.

What vLLM-Omni 0.30.0 does first matters: its Python entry points
(``Omni``, ``AsyncOmni``) resolve the deploy before they load vLLM's
general plugins, so in a script that loads nothing before, the first
``Omni(...)`` is resolved without this wrapper; the plugins load right
after, and :func:`patch_stage_runtime` warns then that keyword settings
were not seen (``vllm serve --omni`` loads plugins when it builds its
parser, so it is never affected). Every hook point is checked by
:func:`vllm_patches.compat.omni.check_vllm_omni` before anything is patched.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_budget.log import logger
from kv_budget.plan.deploy_file import DeployError, settings_a_platform_replaces
from kv_budget.settings import CONFIG_KEY, SETTINGS, settings_from_additional_config
from kv_budget.startup import ModelLocalKVOverrideError
from kv_budget.watch.status import STATUS_DIR_ENV, EngineStatus, read_status, stage_status_paths
from vllm_patches.compat.omni import check_vllm_omni, running_vllm_omni
from vllm_patches.engine import attached_state, existing_state
from vllm_patches.flags import flag_dest, merged_section
from vllm_patches.omni_deployment import lower_driver_copies, record_deployment
from vllm_patches.patching import patch_method


__all__ = ["deployment_settings", "register_omni", "stage_settings"]

_KEYWORDS = {flag_dest(setting): setting.key for setting in SETTINGS}
"""``model_local_kv_policy`` -> ``policy``: the flags' destinations, which
are also the keywords ``Omni(...)`` takes (``vllm serve --omni`` passes its
parsed flags to ``AsyncOmni`` as keywords)."""


# --- in the driver: settings --------------------------------------------------

def deployment_settings(cli_overrides: dict) -> tuple[dict, dict]:
    """(the deployment-wide ``model_local_kv`` section, ``cli_overrides``
    without it). The section is a global ``additional_config["model_local_kv"]``
    with the ``model_local_kv_*`` keywords (flags) winning per key; both are
    removed from what vLLM-Omni resolves, so its merge cannot put them over
    a stage's own."""
    rest = dict(cli_overrides)
    given = {}
    for keyword, key in _KEYWORDS.items():
        value = rest.pop(keyword, None)
        if value is not None:
            given[key] = [value] if key == "overrides" and isinstance(value, str) else value
    additional = rest.get("additional_config")
    section: dict = {}
    if isinstance(additional, dict) and CONFIG_KEY in additional:
        additional = dict(additional)
        section = dict(additional.pop(CONFIG_KEY) or {})
        rest["additional_config"] = additional
    return merged_section(section, given), rest


def stage_settings(deployment: dict, own: dict | None) -> dict:
    """A stage's section: ``deployment``'s keys, the stage's own winning
    per key; overrides from both, the deployment's first."""
    return merged_section(deployment, dict(own or {}))


def _is_llm_stage(stage_config: Any) -> bool:
    return type(stage_config).__name__ != "VllmOmniDiffusionStageConfig"


def apply_to_stages(stage_configs: Any, deployment: dict) -> None:
    """Write each LLM stage's settings into its ``additional_config`` and
    validate them there (ValueError naming the stage); warn for each stage
    that cannot take them."""
    for stage_config in stage_configs:
        runtime = stage_config.runtime_config
        if not _is_llm_stage(stage_config):
            if deployment:
                logger.warning(
                    "stage %s is a diffusion stage: vLLM-Omni gives it no additional_config, so the "
                    "model_local_kv settings %s do not reach it (kv-budget plans LLM stages only)",
                    stage_config.stage_id, sorted(deployment))
            continue
        additional = dict(runtime.additional_config or {})
        merged = stage_settings(deployment, additional.get(CONFIG_KEY))
        if not merged:
            continue
        additional[CONFIG_KEY] = merged
        try:
            settings_from_additional_config(additional)
        except ValueError as exc:
            raise ValueError(f"stage {stage_config.stage_id}: {exc}") from None
        runtime.additional_config = additional


@dataclass
class ResolvedHere:
    """kv-budget's state on a stage config this process's resolver wrapper
    wrote settings into; a stage config without it was resolved before the
    plugin loaded (:func:`patch_stage_runtime` warns). Its presence is the
    fact: it has no fields."""


def warn_platform_replacements(deploy_config_path: str | None) -> None:
    """One warning per stage whose deploy-file ``model_local_kv`` settings
    the running platform's ``platforms:`` section replaced."""
    if not deploy_config_path:
        return
    from vllm_omni.platforms import current_omni_platform


    name = current_omni_platform.device_name
    if not name:
        return
    try:
        lost = settings_a_platform_replaces(deploy_config_path, name.lower(), CONFIG_KEY)
    except (DeployError, OSError, KeyError, TypeError):
        return  # vLLM-Omni read the file; a reading of ours that fails changes nothing it does
    for stage_id, keys in lost.items():
        logger.warning(
            "stage %s: the deploy file's platforms.%s section sets additional_config, which replaces the "
            "stage's own, so its model_local_kv settings %s do not apply on this platform; repeat them in "
            "platforms.%s.stages[stage_id=%s].additional_config.model_local_kv", stage_id, name.lower(), keys,
            name.lower(), stage_id)


def patch_config_resolution(omni_config_cls) -> None:
    """Wrap the classmethod ``VllmOmniConfig.from_pipeline_config``."""

    def wrap(original):
        def from_pipeline_config(cls, pipeline_cfg, *args, cli_overrides=None, **kwargs):
            deployment, rest = deployment_settings(cli_overrides or {})
            warn_platform_replacements(kwargs.get("deploy_config_path"))
            config = original(cls, pipeline_cfg, *args, cli_overrides=rest, **kwargs)
            apply_to_stages(config.stage_configs, deployment)
            for stage_config in config.stage_configs:
                attached_state(stage_config, ResolvedHere)
            return config
        return from_pipeline_config

    patch_method(omni_config_cls, "from_pipeline_config", wrap)


# --- in the driver: the check across stages ----------------------------------------

def stage_statuses(directory: str | Path, pids: set[int]) -> list[EngineStatus]:
    """The status files the stage engine cores ``pids`` wrote in ``directory``."""
    found = []
    for path in stage_status_paths(directory):
        try:
            status = read_status(path)
        except (ValueError, OSError):
            continue
        if status is not None and status.stage is not None and status.pid in pids:
            found.append(status)
    return found


def unmatched_across_stages(statuses: list[EngineStatus]) -> str | None:
    """The refusal for overrides that matched in no stage they were given
    to, naming every stage's declarations; None when every one matched."""
    given: dict[str, list[EngineStatus]] = {}
    for status in statuses:
        for text in status.overrides:
            given.setdefault(text, []).append(status)
    nowhere = [text for text, where in given.items() if all(text in s.unmatched_overrides for s in where)]
    if not nowhere:
        return None
    declared = "; ".join(
        f"{s.stage.label()}: " + (", ".join(sorted({f"{d.owner or '<root>'}/{d.name}" for w in s.plan.workers
                                                     for d in w.declarations})) or "none")
        for s in sorted(statuses, key=lambda s: (s.stage.stage_id, s.stage.replica))
    )
    return (f"kv-budget: model-local KV override(s) {', '.join(map(repr, nowhere))} match no declaration in any "
            f"stage; declarations: {declared}")


def _engine_core_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def check_overrides_across_stages() -> None:
    """Raise :class:`~kv_budget.startup.ModelLocalKVOverrideError` when an
    unqualified override matched in no stage (read from the stages' status
    files, written before each stage answered ready)."""

    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return
    statuses = stage_statuses(directory, _engine_core_pids())
    refusal = unmatched_across_stages(statuses)
    if refusal:
        raise ModelLocalKVOverrideError(refusal)
    given = sorted({text for status in statuses for text in status.overrides})
    if given:
        logger.info("override(s) %s checked across %d stage(s): each matched a declaration in a stage",
                    ", ".join(map(repr, given)), len(statuses))


def patch_stage_runtime(stage_runtime_cls) -> None:
    """Wrap ``StageRuntime._build_logical_stage_init_plans`` (after vLLM-Omni
    loaded the plugins, before any stage starts: the deployment's record for
    its stages to split, :func:`vllm_patches.omni_deployment.record_deployment`;
    at ``_finalize_initialized_stages`` the driver's copies take the final
    split, :func:`~vllm_patches.omni_deployment.lower_driver_copies`),
    and the two places every
    stage is ready: ``StageRuntime._finalize_initialized_stages`` (one API
    server, or a Python driver) and the end of the context manager
    ``StageRuntime.launch_stage_engines`` when it launched the whole
    pipeline (``--api-server-count`` > 1; a regular start enters it once per
    stage).
    Raising at either shuts the stages down."""

    def wrap_plans(original):
        def _build_logical_stage_init_plans(self, *args, **kwargs):
            missed = [s.stage_id for s in self._stage_configs
                      if _is_llm_stage(s) and existing_state(s, ResolvedHere) is None]
            if missed:
                logger.warning(
                    "vLLM-Omni resolved this deployment before it loaded vLLM's general plugins, so "
                    "kv-budget did not see it: model_local_kv_* keywords given to Omni()/AsyncOmni() were dropped, "
                    "and a global additional_config['model_local_kv'] won over stage(s) %s's own keys. Load the "
                    "plugins before the first Omni()/AsyncOmni() of the process (from vllm.plugins import "
                    "load_general_plugins; load_general_plugins())", missed)
            plans = original(self, *args, **kwargs)
            record_deployment(plans)
            return plans
        return _build_logical_stage_init_plans

    def wrap_finalize(original):
        def _finalize_initialized_stages(self, stage_plans, *args, **kwargs):
            check_overrides_across_stages()
            lower_driver_copies(stage_plans)
            return original(self, stage_plans, *args, **kwargs)
        return _finalize_initialized_stages

    def wrap_launch(original):
        @contextlib.contextmanager
        def launch_stage_engines(self, *args, stage_plans=None, **kwargs):
            with original(self, *args, stage_plans=stage_plans, **kwargs) as launch:
                yield launch
            # Without stage_plans it launched the whole pipeline (the serving
            # parent); with them, one stage of a regular start, which
            # _finalize_initialized_stages checks once all are up. The
            # readiness handshake is in the original's exit.
            if stage_plans is None:
                check_overrides_across_stages()
        return launch_stage_engines

    patch_method(stage_runtime_cls, "_build_logical_stage_init_plans", wrap_plans)
    patch_method(stage_runtime_cls, "_finalize_initialized_stages", wrap_finalize)
    patch_method(stage_runtime_cls, "launch_stage_engines", wrap_launch)


# --- registration -----------------------------------------------------------------

def register_omni() -> bool:
    """The vLLM-Omni patches, where vLLM-Omni runs (:func:`running_vllm_omni`);
    True where it patched, so registration patches vLLM-Omni's stat logger too."""
    if not running_vllm_omni():
        return False
    check_vllm_omni()
    from vllm_omni.config.omni_config import VllmOmniConfig
    from vllm_omni.engine.stage_runtime import StageRuntime

    patch_config_resolution(VllmOmniConfig)
    patch_stage_runtime(StageRuntime)
    return True
