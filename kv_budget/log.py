"""kv-budget's one logger, and the one prefix on every line it logs.

Every module logs through :data:`logger`, ``vllm.kv_budget``: a child of
vLLM's ``vllm`` logger, so its lines take vLLM's format, level and handlers
and sit in the stream an operator already reads. Every line starts with
``kv-budget: ``, and in a vLLM-Omni stage engine core with
``[stage S replica R] `` before that: the stages of one deployment log into
one stream, and one word finds every kv-budget line. The prefix is put on
here, once per line, never typed into a message.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "PREFIX", "LogPrefix", "logger", "label_stage"]

LOGGER_NAME = "vllm.kv_budget"
PREFIX = "kv-budget: "

_DONE = "kv_budget_prefixed"
"""Set on a record once its message carries the prefix."""


class LogPrefix(logging.Filter):
    """Starts each record's message with ``[stage label] kv-budget: ``.
    The message is formatted here (its arguments merged), so a message that
    already starts with :data:`PREFIX` (an exception's text logged as it is)
    is not prefixed twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stage_label: str | None = None
        """``stage S replica R`` in a vLLM-Omni stage engine core, else None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _DONE, False):
            return True  # once, however many filters of this kind a record passes
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            return True  # a malformed call is vLLM's handler's to report, as for any other logger
        if not message.startswith(PREFIX):
            message = PREFIX + message
        if self.stage_label:
            message = f"[{self.stage_label}] {message}"
        record.msg, record.args = message, None
        setattr(record, _DONE, True)
        return True


_prefix = LogPrefix()
logger = logging.getLogger(LOGGER_NAME)
logger.addFilter(_prefix)


def label_stage(label: str | None) -> None:
    """Put ``[label]`` before every line this process logs from now on
    (one stage per engine-core process); None takes it off."""
    _prefix.stage_label = label
