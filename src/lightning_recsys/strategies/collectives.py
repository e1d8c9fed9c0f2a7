"""The strategy's own collectives over the default process group (Lightning calls them for metrics and barriers),
and the exact full ranking of an item table over the sharding group (a model calls it for its ranking metrics)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch.distributed as dist
from torch import nn
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from torchrec.distributed.types import ShardedModule
from typing_extensions import override

from lightning_recsys.parallel.comms import comm_purpose
from lightning_recsys.parallel.ranking import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_ROWS, ItemRanking, make_item_ranking
from lightning_recsys.parallel.topology import ParallelTopology


class ProcessGroupCollectives:
    """``barrier``, ``broadcast`` and ``reduce`` for a strategy that owns the default process group.

    Metric reductions are accounted as ``metrics`` traffic.
    """

    root_device: Any
    topology: ParallelTopology

    def item_ranking(
        self,
        module: nn.Module,
        table_name: str,
        normalize_rows: bool = False,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> ItemRanking:
        """The exact full ranking of ``table_name`` in ``module`` (``lightning_recsys.parallel.ranking``): the strategy is an
        ``ItemRankingProvider`` (``lightning_recsys.contracts.ranking``), which is how a model's evaluation reaches it.

        ``module``: the model's ``EmbeddingCollection`` attribute; once sharded, the ``ShardedEmbeddingCollection``
        in its place, ranked inside this rank's sharding group, where every rank calls it with its own users.
        An unsharded module is ranked over its own weight. A chunk of rows is scored at a time: at most
        ``chunk_rows`` rows and ``block_bytes`` of scores. The table is read when this is called: call it again
        after the weights change (once per evaluation loop).
        """
        group = self.topology.sharding_process_group() if isinstance(module, ShardedModule) else None
        ranking = make_item_ranking(
            module, table_name, process_group=group, chunk_rows=chunk_rows, normalize_rows=normalize_rows, block_bytes=block_bytes
        )
        return ranking if group is None else file_under_ranking(ranking)

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


def file_under_ranking(ranking: ItemRanking) -> ItemRanking:
    """``ranking`` (sharded) with its collectives filed under ``ranking`` by the communication accounting.

    Its ``target_ranks`` and ``top_k`` are wrapped on the instance, so it stays a ``ShardedItemRanking``.
    """
    for name in ("target_ranks", "top_k"):
        method = getattr(ranking, name)

        def labelled(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with comm_purpose("ranking"):
                return _method(*args, **kwargs)

        setattr(ranking, name, labelled)
    return ranking
