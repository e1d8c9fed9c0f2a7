import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
