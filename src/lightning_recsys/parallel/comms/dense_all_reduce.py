"""The dense gradients' all-reduce in two stages, for 2D on gloo across nodes.

gloo's all-reduce is a ring over the whole group: ``2 x (world - 1)`` steps, and in a multi-node
world every step waits on a link between nodes, so a small all-reduce pays about that many network
latencies. In 2D the world is a grid of sharding groups and replica groups, so summing inside the
group that stays on a node and then across the other pays the cross-node latency of a ring over
``num_nodes`` ranks only: 2 steps instead of 6 on 2 nodes x 2 ranks. The sum is the same; its
float rounding order differs from the flat ring's (as it does between any two all-reduce algorithms).

NCCL keeps its flat all-reduce: it picks topology-aware algorithms (trees, NVLS) itself.
"""

# No `from __future__ import annotations`: DDP checks the comm hook's `bucket` annotation at runtime.
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_recsys.parallel.topology import ParallelTopology

_WIRE_DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

DenseHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def uses_staged_all_reduce(topology: ParallelTopology, backend: str) -> bool:
    """Whether the dense all-reduce runs in two stages: 2D, across nodes, on gloo."""
    return backend == "gloo" and not topology.is_1d and topology.spans_nodes(list(range(topology.world_size)))


def staged_all_reduce_hook(topology: ParallelTopology, precision: str) -> DenseHook:
    """A DDP comm hook: the bucket's mean over the world, summed first inside the rank's group that stays on a node.

    ``precision``: the wire dtype of both stages (fp32, bf16 or fp16), as ``qcomms.dense_grads_hook``.
    Call on every rank after ``topology.device_mesh``.
    """
    rank = dist.get_rank()
    stages = [
        (topology.sharding_group_of(rank), topology.sharding_process_group()),
        (topology.replica_group_of(rank), topology.replica_process_group()),
    ]
    stages.sort(key=lambda stage: topology.spans_nodes(stage[0]))  # the group inside a node first
    (_, first), (_, second) = stages
    wire_dtype = _WIRE_DTYPES[precision]
    world = topology.world_size

    def hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        wire = buffer.div_(world) if wire_dtype is None else buffer.to(wire_dtype).div_(world)
        # Blocking, in the autograd thread: starting the second stage from the first's completion
        # callback (a gloo worker thread) could order two buckets' collectives differently on two ranks.
        dist.all_reduce(wire, group=first)
        future = dist.all_reduce(wire, group=second, async_op=True).get_future()

        def result(done: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(done.value()[0]) if wire_dtype is not None else done.value()[0]

        return future.then(result)

    return hook
