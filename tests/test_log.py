"""Every kv-budget line carries one prefix, added in one place."""

from __future__ import annotations

import logging

from kv_budget.log import LOGGER_NAME, logger


def test_each_line_gets_the_prefix_once(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        logger.info("cap %d", 90)
        logger.info("%s", "kv-budget: capped 256 -> 90")  # a message built elsewhere, already prefixed
        logger.warning("kv-budget could not plan model-local KV (%s)", "rank 0: boom")
    assert [r.getMessage() for r in caplog.records] == [
        "kv-budget: cap 90", "kv-budget: capped 256 -> 90", "kv-budget could not plan model-local KV (rank 0: boom)"]
