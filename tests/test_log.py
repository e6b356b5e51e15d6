"""Every kv-budget line carries one prefix, put on by the logger, never typed twice."""

from __future__ import annotations

import logging

from kv_budget.log import LOGGER_NAME, LogPrefix, label_stage, logger


def record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord(LOGGER_NAME, logging.INFO, __file__, 1, message, args, None)


def test_a_line_gets_the_prefix_once_however_often_it_passes():
    prefix = LogPrefix()
    line = record("plan %s: %d", "capped", 67)
    assert prefix.filter(line) and line.getMessage() == "kv-budget: plan capped: 67"
    prefix.filter(line)
    assert line.getMessage() == "kv-budget: plan capped: 67"


def test_a_message_that_already_starts_with_the_prefix_is_not_prefixed_again():
    """An exception's text, raised and logged, carries the prefix already."""
    prefix = LogPrefix()
    line = record("%s", "kv-budget: the engine refuses to start")
    prefix.filter(line)
    assert line.getMessage() == "kv-budget: the engine refuses to start"


def test_a_stages_lines_name_it_before_the_prefix():
    prefix = LogPrefix()
    prefix.stage_label = "stage 1 replica 0"
    line = record("%s", "x")
    prefix.filter(line)
    assert line.getMessage() == "[stage 1 replica 0] kv-budget: x"


def test_a_percent_sign_in_a_formatted_message_survives_a_second_formatting():
    prefix = LogPrefix()
    line = record("%d%% of the pool", 5)
    prefix.filter(line)
    assert line.getMessage() == "kv-budget: 5% of the pool"
    assert logging.Formatter("%(message)s").format(line) == "kv-budget: 5% of the pool"


def test_kv_budgets_logger_prefixes_what_it_logs(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        logger.info("one line %d", 1)
        label_stage("stage 2 replica 1")
        try:
            logger.info("another")
        finally:
            label_stage(None)
        logger.info("a third")
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME] == [
        "kv-budget: one line 1", "[stage 2 replica 1] kv-budget: another", "kv-budget: a third"]
