"""Users' own rankers (docs/models-and-metrics.md, "Bring your own ranker"), sharded on 2 processes."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning_recsys.testing.oracle.click import DENSE_LR, EMBEDDING_LR, train_unsharded
from lightning_recsys.testing.processes import run_ranks
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, TwoDRecStrategy
from lightning_recsys.data import RecBatch, SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule, slice_batch
from lightning_recsys.models import RankerModule
from lightning_recsys.parallel.input.batch_check import InvalidInputError
from lightning_recsys.parallel.sharding.sharded_model import local_shards
from lightning_recsys.planner import plan_rows

WORLD_SIZE = 2
STEPS = 3
# TorchRec's planner puts the larger table on rank 0, so its table_wise output order is [sparse_1, sparse_0].
CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64], num_dense_features=4, pooling_factors=[2.0, 2.0], global_batch_size=16, train_batches=STEPS, val_batches=1, seed=3
)


def _tables(config_class: type, prefix: str, dim: int, sizes: list[int]) -> list:
    """One table per size, ``{prefix}{i}`` looked up by feature ``sparse_{i}`` (the synthetic data's names)."""
    return [config_class(name=f"{prefix}{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"sparse_{i}"]) for i, rows in enumerate(sizes)]


class ConcatRanker(RankerModule):
    """Pooled embeddings read by position (``.values()``), as the ranker in docs/models-and-metrics.md does."""

    def __init__(self) -> None:
        super().__init__(dense_optimizer="sgd", dense_lr=DENSE_LR)
        self.ebc = EmbeddingBagCollection(tables=_tables(EmbeddingBagConfig, "t", 8, CONFIG.table_sizes))
        self.mlp = nn.Sequential(nn.Linear(2 * 8 + 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self.mlp(torch.cat([self.ebc(batch.sparse).values(), batch.dense], dim=1)).squeeze(-1)


def _model() -> ConcatRanker:
    torch.manual_seed(0)
    return ConcatRanker()



def _fit_table_wise(rank: int, world_size: int) -> dict:
    model = _model()
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=EMBEDDING_LR),
        planning=PlanningConfig(sharding_types=["table_wise"]),
        process_group_timeout=60,
    )
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    local = CONFIG.global_batch_size // world_size
    batch = slice_batch(SyntheticClickLog(CONFIG).global_batch("val", 0), rank * local, (rank + 1) * local)
    with torch.no_grad():
        predictions = model(batch)
        keys = model.ebc(batch.sparse).keys()
    return {
        "tables": {k: v for k, v in local_shards(model).items() if "embedding_bags" in k},
        "predictions": predictions,
        "keys": keys,
        "sharded_order": list(model.ebc._embedding_names),
    }


def test_pooled_output_keeps_the_unsharded_key_order_and_training_equals_unsharded():
    expected_state, expected_predictions = train_unsharded(model=_model(), config=CONFIG, steps=STEPS)  # SGD at the oracle's rates
    results = run_ranks(_fit_table_wise, WORLD_SIZE, timeout=300)
    # TorchRec's own order differs here, or this test would prove nothing.
    assert results[0]["sharded_order"] == ["sparse_1", "sparse_0"]
    for result in results:
        assert result["keys"] == ["sparse_0", "sparse_1"]
    for key in ("ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"):
        (pieces,) = [r["tables"][key] for r in results if r["tables"].get(key)]  # table_wise: one owner
        torch.testing.assert_close(pieces[0][1], expected_state[key])
    torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions)


class SequenceRanker(RankerModule):
    """An EmbeddingCollection (un-pooled sequence features), summed per example."""

    def __init__(self) -> None:
        super().__init__(dense_optimizer="sgd", dense_lr=DENSE_LR)
        self.ec = EmbeddingCollection(tables=_tables(EmbeddingConfig, "s", 16, SEQUENCE_CONFIG.table_sizes))
        self.head = nn.Linear(2 * 16 + 4, 1)

    def forward(self, batch: RecBatch) -> torch.Tensor:
        sequences = self.ec(batch.sparse)
        pooled = [_sum_per_example(sequences[f"sparse_{i}"].lengths(), sequences[f"sparse_{i}"].values()) for i in range(2)]
        return self.head(torch.cat([*pooled, batch.dense], dim=1)).squeeze(-1)


@torch.fx.wrap
def _sum_per_example(lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    example = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return torch.zeros(lengths.numel(), values.shape[1]).index_add_(0, example, values)


SEQUENCE_CONFIG = SyntheticClickLogConfig(
    table_sizes=[3000, 30], num_dense_features=4, pooling_factors=[2.0, 2.0], global_batch_size=16, train_batches=2, val_batches=1
)


def _fit_sequence_model_with_the_balanced_planner(rank: int, world_size: int) -> dict[str, str]:
    torch.manual_seed(0)
    model = SequenceRanker()
    strategy = TwoDRecStrategy(planning=PlanningConfig(planner="balanced"), process_group_timeout=60)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(SEQUENCE_CONFIG))
    assert trainer.global_step == 2
    return {row["table"]: row["sharding_type"] for row in plan_rows(strategy.sharded_model.plan)}


def test_small_sequence_tables_are_not_planned_data_parallel_on_cpu():
    # The balanced planner made the 30-row sequence table data_parallel; TorchRec's data-parallel
    # EmbeddingCollection lookup returns pooled rows on CPU, so the first forward failed in
    # construct_jagged_tensors ("split_with_sizes expects split_sizes to sum exactly to ...").
    for sharding in run_ranks(_fit_sequence_model_with_the_balanced_planner, WORLD_SIZE, timeout=300):
        assert sharding["s1"] != "data_parallel", sharding


class BufferedRanker(ConcatRanker):
    """Dense buffers next to the tables: a BatchNorm's running statistics and a constant shift drawn per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("shift", torch.randn(4))  # each rank draws its own, as a model built without a common seed

    def forward(self, batch: RecBatch) -> torch.Tensor:
        dense = self.norm(batch.dense - self.shift)
        return self.mlp(torch.cat([self.ebc(batch.sparse).values(), dense], dim=1)).squeeze(-1)


def _fit_buffered_then_validate(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)
    model = BufferedRanker()
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60), max_steps=STEPS,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    data = SyntheticClickLogDataModule.from_config(CONFIG)
    trainer.fit(model, datamodule=data)
    shift = model.shift.clone()
    trainer.validate(model, datamodule=data, verbose=False)
    return {"shift": shift, "running_mean": model.norm.running_mean.clone(), "running_var": model.norm.running_var.clone()}


def test_dense_buffers_are_rank_zeros_on_every_rank_as_under_ddp():
    # DMP's DDP was built with broadcast_buffers=False: buffers were neither synced at the start nor before each
    # forward, so every rank kept its own running statistics (and its own initial buffers) and evaluated another model.
    results = run_ranks(_fit_buffered_then_validate, WORLD_SIZE, timeout=300)
    assert not torch.equal(results[0]["running_mean"], torch.zeros(4))  # the statistics did move
    for key in ("shift", "running_mean", "running_var"):
        torch.testing.assert_close(results[1][key], results[0][key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


RAW_IDS = SyntheticClickLogConfig(
    table_sizes=[4000, 6400], num_dense_features=4, pooling_factors=[2.0, 2.0], global_batch_size=16, train_batches=2, val_batches=1, seed=3
)


class HashingRanker(ConcatRanker):
    """Maps raw ids into its tables in ``on_before_batch_transfer``, a usual place for host-side batch preparation."""

    def on_before_batch_transfer(self, batch: RecBatch, dataloader_idx: int) -> RecBatch:
        kjt = batch.sparse
        values = torch.cat([kjt[key].values() % rows for key, rows in zip(kjt.keys(), CONFIG.table_sizes)])
        return RecBatch(batch.dense, KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths()), batch.labels)


def _fit_hashing(rank: int, world_size: int) -> str:
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60, pipeline="off"), max_steps=2,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(HashingRanker(), datamodule=SyntheticClickLogDataModule.from_config(RAW_IDS))
    except InvalidInputError as error:
        return str(error)
    return ""


def test_an_id_error_says_that_batch_transfer_hooks_run_after_the_check():
    # The ids are checked as the dataloader yields them, before the module's on_before_batch_transfer; the
    # error said only "Set validate_inputs='warn' ... (FBGEMM clamps such ids to row 0)", which is wrong here.
    for message in run_ranks(_fit_hashing, WORLD_SIZE, timeout=300):
        assert "has 40 rows" in message or "has 64 rows" in message, message
        assert "['HashingRanker.on_before_batch_transfer']" in message and "collate_fn" in message and "validate_inputs='off'" in message, message
