"""2D with row-wise Adagrad (4 processes as 2 nodes x 2): ``ReplicaSyncConfig.average`` on rows one replica touched.

TorchRec divides the all-to-all's gradients by the sharding group's size (``comm_ops.set_gradient_division``),
so each replica's tables see its half of the global batch as a whole batch. Row-wise Adagrad's first step
is ``lr * g / sqrt(mean(g^2))``, the same whatever the scale of ``g``: a row only one replica looked up
takes 1D's step on that replica and none on the other. Averaged over the replicas that touched it
(``"auto"`` with an adaptive optimizer) it keeps that step; averaged over all replicas it keeps half.
"""

from __future__ import annotations

import torch
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.click import CONFIG, TABLE_KEY, make_model, shards_of
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogDataModule, slice_batch

WORLD_SIZE, NODES, PER_NODE = 4, 2, 2
FEATURE = "sparse_0"  # served by TABLE_KEY's table
VARIANTS = {"1d": (WORLD_SIZE, "auto"), "auto": (PER_NODE, "auto"), "all_replicas": (PER_NODE, "all_replicas")}


def _one_adagrad_step(rank: int, world_size: int) -> dict:
    from lightning.pytorch import Trainer

    results = {}
    for name, (group_size, average) in VARIANTS.items():
        strategy = TwoDRecStrategy(
            sharding_group_size=group_size,
            embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.3),
            replica_sync=ReplicaSyncConfig(average=average),  # type: ignore[arg-type]
            planning=PlanningConfig(sharding_types=["row_wise"]),
            process_group_timeout=60,
        )
        trainer = Trainer(
            accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=1, limit_val_batches=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        model = make_model()
        trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
        touching = strategy._runtime.replica_sync.count_aware if strategy._runtime.replica_sync is not None else None
        results[name] = {"shards": shards_of(model), "touching": touching, "described": strategy._runtime.describe_replica_sync()}
    return results


def _rows_by_replica() -> tuple[set[int], set[int]]:
    """The table's rows each node's ranks looked up in the first global batch (node 0 has its first half)."""
    batch = SyntheticClickLog(CONFIG).global_batch("train", 0)
    half = CONFIG.global_batch_size // 2
    first, second = (slice_batch(batch, start, start + half).sparse[FEATURE].values().tolist() for start in (0, half))
    return set(first), set(second)


def test_a_row_one_replica_touched_moves_as_far_as_in_1d_with_the_auto_average():
    results = run_ranks(_one_adagrad_step, WORLD_SIZE, timeout=300, ranks_per_node=PER_NODE)
    assert [r["auto"]["touching"] for r in results] == [True] * WORLD_SIZE
    assert [r["all_replicas"]["touching"] for r in results] == [False] * WORLD_SIZE
    assert "averaged over the replicas that touched it (average='auto', embedding optimizer rowwise_adagrad)" in results[0]["auto"]["described"]
    assert "averaged over all replicas (average='all_replicas'" in results[0]["all_replicas"]["described"]
    initial = make_model().state_dict()[TABLE_KEY]
    table = {name: assemble([r[name]["shards"] for r in results], TABLE_KEY, initial) for name in VARIANTS}

    first, second = _rows_by_replica()
    one_replica = sorted(first ^ second)
    assert one_replica and first & second, "the batch should have rows touched by one replica and by both"
    rows = torch.tensor(one_replica)
    moved_1d = table["1d"][rows] - initial[rows]
    assert moved_1d.abs().min() > 0, "1D training left a touched row where it was"
    torch.testing.assert_close(table["auto"][rows] - initial[rows], moved_1d, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(table["all_replicas"][rows] - initial[rows], moved_1d / 2, rtol=1e-4, atol=1e-6)
    untouched = torch.tensor(sorted(set(range(initial.shape[0])) - first - second))
    for name in VARIANTS:
        assert torch.equal(table[name][untouched], initial[untouched]), f"{name}: a row nobody looked up moved"
