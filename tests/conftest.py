"""Session-wide test settings.

Every engine started by the tests (and the processes they spawn) records
its model-local KV in a device ledger keyed by the host. A ledger of this
run's own keeps engines of another test run, or a developer's server, on
the same machine from lowering the caps the tests compute by hand.
"""

from __future__ import annotations

import os

import pytest

from kv_budget.ledger import LEDGER_DIR_ENV


@pytest.fixture(scope="session", autouse=True)
def private_device_ledger(tmp_path_factory):
    previous = os.environ.get(LEDGER_DIR_ENV)
    os.environ[LEDGER_DIR_ENV] = str(tmp_path_factory.mktemp("device-ledger"))
    yield os.environ[LEDGER_DIR_ENV]
    if previous is None:
        os.environ.pop(LEDGER_DIR_ENV, None)
    else:
        os.environ[LEDGER_DIR_ENV] = previous
