"""The API-server process: learn the engine's cap, publish its figures.

vLLM runs the engine core in a process of its own; the API-server process
(the "frontend", where ``AsyncLLM`` and the OpenAI routes live) holds a copy
of the ``VllmConfig`` made before the engine core started. The startup plan
lowers ``max_num_seqs`` in the engine core's copy only, so two things would
otherwise stay wrong in the frontend:

**The cap** (:func:`patch_ready_response`). At the end of startup every
engine core sends its frontends an ``EngineCoreReadyResponse`` carrying its
``max_num_seqs``; ``MPClient._apply_ready_response`` copies several of its
fields (``max_model_len``, the block counts) into the frontend's config but
not that one. The wrapper copies it too, lowering only (several
data-parallel engines each answer: the frontend keeps the minimum), with
``max_num_active_seqs`` where the vLLM has one. What reads it in the
frontend: the token-in/token-out endpoint (``/inference/v1/generate``,
under ``--enable-scale-out``) rejects a request whose ``n`` exceeds it,
``/server_info`` (``VLLM_SERVER_DEV_MODE=1``) reports it, and the offline
pooling path sizes how many requests it keeps in the engine from it. With
the configured value those would admit ``n`` sequences the engine never
runs at once and report a limit that is not in force. Under ``reserve``,
``warn`` and ``off`` the engine's value is the configured one and nothing
changes. The hook point is checked by ``compat.check_vllm``
(``MPClient._apply_ready_response(self, payload)``,
``EngineCoreReadyResponse.max_num_seqs``).

**The figures** (:class:`KvBudgetStatLogger`). The plan and the live
monitor's figures are in the engine core; the status file
(:mod:`kv_budget.watch.status`) brings them here, and this stat logger
publishes them as ``kv_budget:``
gauges on vLLM's own ``/metrics`` (names, help texts and labels:
:mod:`kv_budget.watch.metrics`). vLLM builds one instance per engine index
(``PerEngineStatLoggerAdapter``); the gauges themselves are created once
per process, because a Prometheus registry refuses a second metric of the
same name, and the instances share them through the ``engine`` label.
They are ``multiprocess_mode="mostrecent"`` like vLLM's own gauges: with
``--api-server-count`` > 1 vLLM sets ``PROMETHEUS_MULTIPROC_DIR``, every
API-server process writes its values to files there, and ``/metrics`` in
any of them aggregates the files, taking for each series the value set
last (every process reads the same status file, so they agree).

When it refreshes: at ``log_engine_initialized`` (the plan is there
already: the engine wrote it before answering ready), at every ``log``
(vLLM's API server calls it every ``VLLM_LOG_STATS_INTERVAL`` seconds, idle
or not), and at ``record`` (after engine outputs) at most once per
:data:`REFRESH_INTERVAL_S`. No status directory, or no file (policy
``off``/``reserve``, or an engine that has not written yet), means nothing
to publish and no error; a file that is not a status logs one warning.

**In vLLM-Omni's driver** (:func:`patch_omni_stat_logger`). vLLM-Omni's
orchestrator never builds vLLM's ``AsyncLLM`` and never loads
``vllm.stat_logger_plugins``; it builds its own ``OmniPrometheusStatLogger``,
one per driver, which relabels vLLM's ``engine`` label to ``stage`` and
``replica``. The wrapper gives it one :class:`KvBudgetStatLogger` per stage
and replica, labelled the same way, and a thread that refreshes them every
:data:`REFRESH_INTERVAL_S`: vLLM-Omni records only when a stage hands back
outputs and never calls ``log``, so refreshing as it records would leave
the sample a stage takes as its load drains (which may still lower its
live limit) unpublished until its next request.

**Only where stats are on** (:func:`patch_async_llm`). vLLM turns stats
on for every ``AsyncLLM`` that has a custom stat logger, even under
``--disable-log-stats`` ("enabling logging without default stat
loggers"), and loads the ``vllm.stat_logger_plugins`` entry points into
every one. So this logger is no such entry point: ``AsyncLLM.__init__``
gets it in its ``stat_loggers`` argument when ``log_stats`` is true, and
not otherwise. Under ``--disable-log-stats`` the ``kv_budget:`` series are
absent from ``/metrics`` (one info line says so); the plan and the live
findings stay in the log, the report file and the status file.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import msgspec
from vllm.v1.engine import EngineCoreReadyResponse
from vllm.v1.metrics.loggers import StatLoggerBase

from kv_budget.log import logger
from kv_budget.stage import Stage
from kv_budget.watch.metrics import METRICS, label_names, status_samples
from kv_budget.watch.status import STATUS_DIR_ENV, read_status, stage_status_paths, status_path
from vllm_patches.engine import lower_max_num_seqs
from vllm_patches.patching import patch_method


__all__ = [
    "REFRESH_INTERVAL_S", "KvBudgetStatLogger", "lower_frontend_max_num_seqs", "patch_async_llm",
    "patch_omni_stat_logger", "patch_ready_response", "refresh_while_alive", "stat_logger_where_stats_are_on",
]

REFRESH_INTERVAL_S = 1.0
"""Least seconds between two reads of the status file from ``record``, and
the period of vLLM-Omni's refresher: the engine rewrites it at most once per
live sample (1 s by default), and ``record`` runs after every engine output batch."""


# --- the cap ---------------------------------------------------------------

def lower_frontend_max_num_seqs(vllm_config: Any, engine_max_num_seqs: int, engine_index: int) -> list[str]:
    """Lower the frontend's ``max_num_seqs`` (and ``max_num_active_seqs``,
    where it exists and is larger) to an engine's; never raise it. Returns
    what changed, as ``"field old -> new"``, empty when nothing did."""
    applied = lower_max_num_seqs(vllm_config.scheduler_config, engine_max_num_seqs)
    if not applied:
        return []
    logger.info("frontend %s (engine %d's ready response)", "; ".join(applied), engine_index)
    return applied


def patch_ready_response(mp_client_cls) -> None:
    """After ``MPClient._apply_ready_response``, take the engine's
    ``max_num_seqs`` from the same payload; idempotent. The payload is
    decoded as vLLM decodes it; an empty one (some versions send none)
    carries nothing to take."""

    def wrap(original):
        def _apply_ready_response(self, payload):
            original(self, payload)
            if not payload:
                return
            response = msgspec.msgpack.decode(payload, type=EngineCoreReadyResponse)
            lower_frontend_max_num_seqs(self.vllm_config, response.max_num_seqs, response.data_parallel_rank)
        return _apply_ready_response

    patch_method(mp_client_cls, "_apply_ready_response", wrap)


# --- the figures -----------------------------------------------------------

class Gauges:
    """The process's ``kv_budget:`` gauges, created on first use, labelled
    as vLLM's series (``engine``) or, with ``staged``, as vLLM-Omni's
    (``stage``, ``replica``). One table per process: a Prometheus registry
    holds one metric per name, so a process publishes one kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, Any] = {}
        self._staged: bool | None = None
        self._warned: set[str] = set()

    def table(self, staged: bool = False) -> dict[str, Any]:
        """Metric name -> gauge, labelled for ``staged``."""
        from prometheus_client import Gauge

        with self._lock:
            if self._staged is None:
                for spec in METRICS:
                    self._table[spec.name] = Gauge(spec.name, spec.help, labelnames=label_names(spec, staged),
                                                   multiprocess_mode="mostrecent")
                self._staged = staged
            elif self._staged != staged:
                raise RuntimeError("kv-budget: this process publishes both vLLM engines and vLLM-Omni stages; "
                                   "their kv_budget: series cannot share one registry")
        return self._table

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` (a status file, a failed
        refresh) comes up in this process: one warning each, not one per
        second."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(message, *args)


_gauges = Gauges()
"""This process's gauges."""


def served_model_name(vllm_config: Any) -> str:
    """The ``model_name`` label vLLM's own series carry."""
    model_config = vllm_config.model_config
    name = getattr(model_config, "served_model_name", None) or model_config.model
    return str(name[0] if isinstance(name, (list, tuple)) else name)


class KvBudgetStatLogger(StatLoggerBase):
    """Publishes one engine's kv-budget status as ``kv_budget:`` gauges
    (the module docstring says when and why this way)."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, stage: Stage | None = None):
        self.engine_index = engine_index
        self.stage = stage
        """The vLLM-Omni stage and replica whose figures this publishes (None: a vLLM engine)."""
        self.model = str(vllm_config.model_config.model)
        """As the engine core names its status file (``vllm_patches.live_hook``)."""
        self.model_name = served_model_name(vllm_config)
        self._last_refresh: float | None = None
        self._last_seen: tuple[int, int] | None = None
        self._refreshing = threading.Lock()
        """vLLM-Omni's refresher thread and its orchestrator (a new replica) may refresh at once."""
        _gauges.table(staged=stage is not None)

    def status_file(self) -> Path | None:
        """The engine's status file. A vLLM-Omni stage's is found by its
        stage and replica: the driver's config is the first stage's, and
        another stage may serve another model path."""
        directory = os.environ.get(STATUS_DIR_ENV)
        if not directory:
            return None
        if self.stage is None:
            return status_path(directory, self.model, self.engine_index)
        found = stage_status_paths(directory, self.engine_index, self.stage)
        return found[-1] if found else None

    def refresh(self) -> int:
        """Publish the status file's figures; return how many samples were
        set (0 when there is nothing to publish or it did not change)."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> int:
        self._last_refresh = time.monotonic()
        path = self.status_file()
        if path is None:
            return 0
        try:
            stat = path.lstat()
        except FileNotFoundError:
            return 0
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._last_seen:
            return 0
        try:
            status = read_status(path)
        except (ValueError, OSError) as exc:
            _gauges.warn_once(str(path), "metrics not published: %s", exc)
            return 0
        if status is None:
            return 0
        table = _gauges.table(staged=self.stage is not None)
        samples = status_samples(status, self.model_name)
        for sample in samples:
            table[sample.name].labels(**sample.labels).set(sample.value)
        self._last_seen = seen
        return len(samples)

    def _refresh_guarded(self) -> None:
        # vLLM calls record() from the loop that hands engine outputs to
        # requests: a metrics problem must not fail them.
        try:
            self.refresh()
        except Exception as exc:  # noqa: BLE001 - logged once, never raised into vLLM
            _gauges.warn_once(f"refresh:{self.engine_index}", "metrics refresh failed: %r", exc)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if self._last_refresh is None or time.monotonic() - self._last_refresh >= REFRESH_INTERVAL_S:
            self._refresh_guarded()

    def log_engine_initialized(self):
        self._refresh_guarded()

    def log(self):
        self._refresh_guarded()


def stat_logger_where_stats_are_on(original):
    """Wrap ``AsyncLLM.__init__``: add :class:`KvBudgetStatLogger` to its
    ``stat_loggers`` when ``log_stats`` is true, change nothing otherwise."""
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs)
        if call.arguments["log_stats"]:
            call.arguments["stat_loggers"] = [*(call.arguments.get("stat_loggers") or ()), KvBudgetStatLogger]
        else:
            logger.info("stats are off (--disable-log-stats): the kv_budget: series are not "
                        "published on /metrics; the plan and live findings stay in this log")
        original(*call.args, **call.kwargs)
    return __init__


def patch_async_llm(async_llm_cls) -> None:
    """The ``kv_budget:`` figures on ``/metrics`` where vLLM logs stats."""
    patch_method(async_llm_cls, "__init__", stat_logger_where_stats_are_on)


# --- vLLM-Omni's stat logger ---------------------------------------------------

def patch_omni_stat_logger(stat_logger_cls) -> None:
    """Wrap ``OmniPrometheusStatLogger.__init__`` and ``register_replica``:
    one kv-budget logger per (stage, replica), refreshed every
    :data:`REFRESH_INTERVAL_S` by :func:`refresh_while_alive`."""
    def add(self, engine_idx: int, stage: str, replica: str) -> None:
        staged = Stage(stage_id=int(stage), replica=int(replica))
        self._kv_budget_loggers[engine_idx] = KvBudgetStatLogger(self.vllm_config, 0, staged)
        self._kv_budget_loggers[engine_idx].log_engine_initialized()

    def wrap_init(original):
        def __init__(self, vllm_config, stage_replica_map):
            original(self, vllm_config, stage_replica_map)
            self._kv_budget_loggers = {}
            for engine_idx, (stage, replica) in dict(stage_replica_map).items():
                add(self, engine_idx, stage, replica)
            refresh_while_alive(self)
        return __init__

    def wrap_register(original):
        def register_replica(self, engine_idx, stage, replica):
            original(self, engine_idx, stage, replica)
            if engine_idx not in self._kv_budget_loggers:
                add(self, engine_idx, stage, replica)
        return register_replica

    patch_method(stat_logger_cls, "__init__", wrap_init)
    patch_method(stat_logger_cls, "register_replica", wrap_register)


def refresh_while_alive(stat_logger: Any) -> threading.Thread:
    """Start a daemon thread that refreshes ``stat_logger``'s kv-budget
    loggers every :data:`REFRESH_INTERVAL_S`, idle or not, until the stat
    logger is gone (it holds it weakly, so a driver that drops it stops it)."""
    owner = weakref.ref(stat_logger)

    def run() -> None:
        while (current := owner()) is not None:
            loggers = list(current._kv_budget_loggers.values())
            del current
            for kv_budget_logger in loggers:
                kv_budget_logger._refresh_guarded()
            del loggers
            time.sleep(REFRESH_INTERVAL_S)

    thread = threading.Thread(target=run, name="kv-budget-metrics", daemon=True)
    thread.start()
    return thread
