"""The balanced planner: a load-aware TorchRec sharding planner balancing storage, lookups, comm bytes and step time.

It is TorchRec's ``EmbeddingShardingPlanner`` with our components in its extension points:

* ``BalancedEnumerator`` (``enumerator.py``, an ``EmbeddingEnumerator``): TorchRec's sharding options, with the
  pooling factors of the observed traffic in the constraints (so TorchRec's own perf and storage
  estimates see the real load), plus column-wise options with more column splits than TorchRec
  enumerates (it offers one split per table).
* ``BalancedProposer`` (``proposer.py``): steepest descents over the tables' sharding options, from several
  starts (from "cheapest option per table" to "no shard above a quarter of a rank's load"),
  re-sharding the tables that load the bottleneck rank of each metric, rated by the planner loop.
* ``BalancedPartitioner`` (``partitioner.py``): places shards to minimize the largest per-rank load of each metric
  (greedy largest-first, or warm-started from the best plan so far, then moves and swaps off the
  bottleneck ranks), within the memory left after the storage reservation; row-wise and
  data-parallel shards keep TorchRec's fixed layout.
* ``BalancedPerfModel`` (``perf_model.py``): rates a placed plan by the ``BalanceObjective`` (``shard_cost``): per
  metric (storage, lookups, comm bytes, TorchRec's step-time estimate) the largest per-rank load
  in units of ``ref_m``, plus a penalty for imbalance beyond a tolerance. ``ref_m`` is the per-rank share of the cheapest
  sharding of every table: a fixed yardstick, so plans that add traffic pay for it.

Hash partitions: a table whose ids are hashed into ``P`` partitions of ``rows / P`` contiguous rows
is sharded row-wise with ``P / G`` whole partitions per rank (``G``: the sharding group size).

2D: the planner plans one sharding group (``sharding_group_size`` ranks, ``group_ranks_per_node`` of
them per node); every replica group uses the same plan. No Lightning imports.

They share one ``BalanceContext`` (``context.py``) per ``plan()`` call; ``BalancedPlanner``
(``planner.py``) wires them into TorchRec's planner loop. One role per module, as in
``torchrec/distributed/planner/``.
"""

from lightning_recsys.planner.balanced.context import BalanceContext
from lightning_recsys.planner.balanced.enumerator import BalancedEnumerator
from lightning_recsys.planner.balanced.partitioner import BalancedPartitioner
from lightning_recsys.planner.balanced.perf_model import BalancedPerfModel
from lightning_recsys.planner.balanced.planner import BalancedPlanner, PlanResult, make_balanced_plan
from lightning_recsys.planner.balanced.proposer import BalancedProposer

__all__ = [
    "BalanceContext",
    "BalancedEnumerator",
    "BalancedPartitioner",
    "BalancedPerfModel",
    "BalancedPlanner",
    "BalancedProposer",
    "PlanResult",
    "make_balanced_plan",
]
