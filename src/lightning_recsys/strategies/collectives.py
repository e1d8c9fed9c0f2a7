"""The strategy's own collectives over the default process group (Lightning calls them for metrics and barriers)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from typing_extensions import override

from lightning_recsys.parallel.comms import comm_purpose


class ProcessGroupCollectives:
    """``barrier``, ``broadcast`` and ``reduce`` for a strategy that owns the default process group.

    Metric reductions are accounted as ``metrics`` traffic.
    """

    root_device: Any

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            with comm_purpose("metrics"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
