import os

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import PORT_RANGE_ENV, free_port

_TEST_PORTS = (20000, 32768)  # below the kernel's ephemeral ports; see PORT_RANGE_ENV


def pytest_configure(config):
    """Under pytest-xdist each worker draws ports from its own slice of _TEST_PORTS: workers cannot race for one
    port. One pytest process alone keeps the kernel's ephemeral ports, as two such sessions side by side would
    collide on slices of the same range."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
        width = (_TEST_PORTS[1] - _TEST_PORTS[0]) // workers
        low = _TEST_PORTS[0] + index * width
        os.environ.setdefault(PORT_RANGE_ENV, f"{low}-{low + width}")


@pytest.fixture(autouse=True)
def _lightning_port_from_this_workers_range(monkeypatch):
    """Lightning picks MASTER_PORT with bind(("", 0)) unless STANDALONE_PORT is set; under pytest-xdist a Trainer
    this test starts (here or in a subprocess) takes one from this worker's slice instead."""
    if PORT_RANGE_ENV in os.environ:
        monkeypatch.setenv("STANDALONE_PORT", str(free_port()))


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with nccl; this machine has none (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
