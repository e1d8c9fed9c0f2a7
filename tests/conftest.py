import pytest
import torch
import torch.distributed as dist


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
