"""kv-budget's one logger, and its one prefix.

Every line goes to ``vllm.kv_budget``, so it takes vLLM's own format and
handlers in every process (the API server, the engine core, each worker);
the ``kv-budget:`` prefix is added here, once, so an operator can grep for
it whatever module logged (a vLLM-Omni stage's lines get ``[stage S replica
R]`` before it, :class:`vllm_patches.engine.StageLogPrefix`).
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "PREFIX", "logger"]

LOGGER_NAME = "vllm.kv_budget"
PREFIX = "kv-budget: "


class _Prefix(logging.Filter):
    """Put :data:`PREFIX` before a line that does not start with ``kv-budget`` already."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and not record.getMessage().startswith("kv-budget"):
            record.msg = PREFIX + record.msg
        return True


logger = logging.getLogger(LOGGER_NAME)
if not any(isinstance(f, _Prefix) for f in logger.filters):
    logger.addFilter(_Prefix())
