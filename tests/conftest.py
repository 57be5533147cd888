import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pool import WorkerPool  # noqa: E402
from interpreted_runs import start_collected, stop_all  # noqa: E402

torch.set_num_threads(1)

_pools = {}


def _pool(world_size):
    if world_size not in _pools:
        _pools[world_size] = WorkerPool(world_size)
    return _pools[world_size]


@pytest.fixture(scope="session")
def pool2():
    return _pool(2)


@pytest.fixture(scope="session")
def pool4():
    return _pool(4)


@pytest.fixture(scope="session")
def pools():
    """``pools(ws)``: the shared pool of ``ws`` gloo ranks."""
    return _pool


def pytest_collection_finish(session):
    start_collected(session.config, session.items)  # the interpreted runs, beside the rest of the suite


def pytest_sessionfinish(session, exitstatus):
    stop_all(session.config)
    for p in _pools.values():
        p.close()
    _pools.clear()
