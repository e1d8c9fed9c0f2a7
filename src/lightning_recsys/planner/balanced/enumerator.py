"""BalancedEnumerator: TorchRec's sharding options plus finer column-wise splits. No Lightning imports."""

from __future__ import annotations

import copy

from torch import nn
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import Shard, ShardingOption, Topology
from torchrec.distributed.types import ModuleSharder, ShardingType


class BalancedEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator plus column-wise options with every even split TorchRec would accept.

    TorchRec enumerates one column-wise split per table (its widths are multiples of 4 that
    divide the dim, at least ``min_partition``, default 128). This adds the other such widths of
    at least ``min_column_width`` columns, up to ``max_column_shards`` shards, so the planner can
    cut a table just as finely as balance needs.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        *,
        min_column_width: int = 4,
        max_column_shards: int | None = None,
    ) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        if min_column_width < 4 or min_column_width % 4:
            raise ValueError(f"min_column_width={min_column_width} must be a multiple of 4 (FBGEMM's alignment), >= 4.")
        self._min_column_width = min_column_width
        self._max_column_shards = max_column_shards or topology.world_size
        self.last_search_space: list[ShardingOption] = []

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        extra: list[ShardingOption] = []
        for option in options:
            if option.sharding_type != ShardingType.COLUMN_WISE.value:
                continue
            rows, dim = int(option.tensor.shape[0]), int(option.tensor.shape[1])
            floor = (self._constraints or {}).get(option.name)
            lowest = max(self._min_column_width, (floor.min_partition or 0) if floor else 0)
            lowest = -(-lowest // 4) * 4  # FBGEMM needs widths that are multiples of 4
            present = {len(option.shards)}
            for width in range(lowest, dim + 1, 4):
                shards = dim // width
                if dim % width or shards in present or shards > self._max_column_shards:
                    continue
                present.add(shards)
                variant = copy.deepcopy(option)
                variant.shards = [Shard(size=[rows, width], offset=[0, i * width]) for i in range(shards)]
                extra.append(variant)
        if extra:
            self.populate_estimates(extra)
        self.last_search_space = options + extra
        return self.last_search_space
