"""Every process group the job makes has its collective timeout: the 2D mesh's subgroups and the async checkpoint writers'.

Both used to get gloo's default of 30 minutes (``new_group(timeout=None)``), so a collective on
them across a lost link waited half an hour instead of ``process_group_timeout``. Rank 0 runs an
all-reduce on each group that its peer in it never joins: each must fail within the timeout.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.checkpoint.async_save import AsyncCheckpointSaver
from lightning_recsys.parallel.topology import ParallelTopology

TIMEOUT = timedelta(seconds=3)


def _all_reduce_alone(rank: int, world_size: int) -> dict[str, float]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        # 2 sharding groups of 2: rank 0's replica group [0, 2] is a mesh subgroup (one spanning the world would be WORLD).
        topology = ParallelTopology(world_size=4, sharding_group_size=2)
        topology.device_mesh("cpu", timeout=TIMEOUT)
        saver = AsyncCheckpointSaver(topology, timeout=TIMEOUT)  # writers: sharding group 0, [0, 1]
        groups = {"replica group": topology.replica_process_group(), "checkpoint writers": saver._group}
        took = {}
        if rank == 0:
            for name, group in groups.items():
                started = time.monotonic()
                with pytest.raises(RuntimeError, match="[Tt]imed out"):
                    dist.all_reduce(torch.ones(1), group=group)
                took[name] = time.monotonic() - started
        dist.barrier()  # the default group (60 s): the others stay until rank 0 is done
        return took
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_mesh_subgroups_and_the_checkpoint_writers_group_time_out_at_the_jobs_timeout():
    took = run_ranks(_all_reduce_alone, 4, timeout=120)[0]
    assert sorted(took) == ["checkpoint writers", "replica group"]
    for name, seconds in took.items():
        assert seconds < TIMEOUT.total_seconds() + 5, (name, seconds)
