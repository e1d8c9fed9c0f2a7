"""SequencePretrainer under TwoDRecStrategy on 2 processes (gloo): sharded SGD equals unsharded SGD, negatives included."""

from __future__ import annotations

import pytest
import torch
from lightning_recsys.testing.oracle import RecordPipeline, assemble
from lightning_recsys.testing.oracle.pretrain import (
    ACTION_KEY, ITEM_KEY, ITEMS, STEPS, PretrainDataModule, fit_sharded, is_table, make_model, sgd_strategy, table_shards, touched_rows,
    train_unsharded,
)
from lightning_recsys.testing.processes import run_ranks

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def oracle():
    return train_unsharded(WORLD_SIZE).state


def _fit(rank: int, world_size: int, sharding_type: str) -> dict:
    model, record = make_model(), RecordPipeline()
    _, trainer, _ = fit_sharded(rank, world_size, sgd_strategy(sharding_types=[sharding_type]), model=model, callbacks=[record])
    assert trainer.global_step == STEPS
    return {
        "shards": table_shards(model),
        "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if not is_table(k)},
        "pipeline_off": record.disabled_reason,
        "pipelined": sorted(record.pipelined),
    }


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_sharded_training_equals_unsharded_and_negatives_update_exactly_the_sampled_rows(sharding_type, oracle):
    results = run_ranks(_fit, WORLD_SIZE, sharding_type, timeout=300)
    initial = make_model().state_dict()
    for key, expected in oracle.items():
        if is_table(key):
            torch.testing.assert_close(assemble([r["shards"] for r in results], key, expected), expected, msg=lambda m: f"{key}: {m}")
        else:
            for result in results:
                torch.testing.assert_close(result["dense"][key], expected, msg=lambda m: f"{key}: {m}")
    items = assemble([r["shards"] for r in results], ITEM_KEY, oracle[ITEM_KEY])
    changed = set(torch.nonzero((items != initial[ITEM_KEY]).any(dim=1)).flatten().tolist())
    # Every row that reached a loss moved (kept inputs and targets, and the rows only sampled as negatives) and
    # no other row did: not even the inputs cut off beyond max_length, which are looked up with a zero gradient.
    assert changed == touched_rows(kept_only=True) and touched_rows(kept_only=True) < touched_rows()
    negatives_only = touched_rows() - set(range(ITEMS // 2))  # the data draws inputs and targets from the lower half
    assert negatives_only and negatives_only <= changed
    assert not torch.allclose(assemble([r["shards"] for r in results], ACTION_KEY, oracle[ACTION_KEY]), initial[ACTION_KEY])
    if sharding_type == "column_wise":
        assert any(offsets[1] > 0 for r in results for pieces in r["shards"].values() for offsets, _ in pieces)
    for result in results:  # one lookup for inputs, targets and negatives: the sparse-dist pipeline keeps it
        assert result["pipeline_off"] is None and result["pipelined"] == ["item_embeddings"], result


INIT_STD = 0.5


def _meta_tables(rank: int, world_size: int, sharding_type: str) -> dict:
    model = make_model(embedding_device="meta", seed=100 + rank, init_std=INIT_STD)
    fit_sharded(rank, world_size, sgd_strategy(sharding_types=[sharding_type]), model=model, steps=1)
    return table_shards(model)


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_tables_built_on_meta_start_at_init_std_on_every_shard(sharding_type):
    """TorchRec's ShardedEmbeddingCollection.reset_parameters applies EmbeddingConfig.init_fn to the shards it materialises."""
    results = run_ranks(_meta_tables, WORLD_SIZE, sharding_type, timeout=300)
    like = torch.zeros(ITEMS, make_model().embedding_dim)
    items = assemble(results, ITEM_KEY, like)
    # TorchRec's default would be uniform(+-1/sqrt(ITEMS)): a std of 0.07 here.
    assert abs(float(items.std()) - INIT_STD) < 0.1
    for pieces in results:
        for _, shard in pieces[ITEM_KEY]:
            assert abs(float(shard.std()) - INIT_STD) < 0.15


def _fit_and_save(rank: int, world_size: int, ckpt_dir: str) -> dict:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = make_model(embedding_device="meta", seed=100 + rank)  # only the shards exist
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=["row_wise"]), max_steps=2, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="fitted")],
    )
    trainer.fit(model, datamodule=PretrainDataModule())
    return {"shards": table_shards(model), "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if not is_table(k)}}


def test_load_from_checkpoint_reads_the_sharded_pretrainer_into_one_process(tmp_path):
    from lightning_recsys.models import SequencePretrainer

    results = run_ranks(_fit_and_save, WORLD_SIZE, str(tmp_path), timeout=300)
    model = SequencePretrainer.load_from_checkpoint(tmp_path / "fitted.ckpt")  # a DCP directory; meta tables built on the CPU
    assert model.hparams.embedding_device is None and model.hparams.in_batch_negatives
    state = model.state_dict()
    for key in (ITEM_KEY, ACTION_KEY):
        assert torch.equal(assemble([r["shards"] for r in results], key, state[key]), state[key]), key
    for key, value in results[0]["dense"].items():
        assert torch.equal(state[key], value), key


QCOMMS_DIM = 16  # fp8 and int8 scale blocks of 8 or 16 values (at 4 they run as bf16)


def _fit_quantized(rank: int, world_size: int, precision: str) -> dict:
    from lightning_recsys import QCommsConfig

    strategy = sgd_strategy(sharding_types=["row_wise"], qcomms=QCommsConfig(forward=precision, backward=precision))
    model = make_model(embedding_dim=QCOMMS_DIM)
    fit_sharded(rank, world_size, strategy, model=model, steps=1)
    return {"shards": table_shards(model), "effective": strategy.effective_qcomms.precisions["sequence_all_to_all"]}


# The largest error of one step's update, relative to the largest update (measured on this case: bf16 0.020, fp8
# 0.036, int8 0.012). Each bound allows about 2x that within its format's rounding (bf16 keeps 8 significant bits,
# fp8 e4m3/e5m2 4/3, int8 1/127 of a block's largest value), amplified by the softmax at temperature 0.5.
@pytest.mark.parametrize("precision, tolerance", [("bf16", 5e-2), ("fp8", 1e-1), ("int8", 3e-2)])
def test_quantized_sequence_all_to_all_with_negatives_stays_near_unsharded(precision, tolerance):
    """Inputs, targets and negatives ride the quantized sequence all-to-all; one step's table update stays near fp32's."""
    expected = train_unsharded(WORLD_SIZE, steps=1, embedding_dim=QCOMMS_DIM).state[ITEM_KEY]
    initial = make_model(embedding_dim=QCOMMS_DIM).state_dict()[ITEM_KEY]
    results = run_ranks(_fit_quantized, WORLD_SIZE, precision, timeout=300)
    assert all(r["effective"][0] == precision or r["effective"][0].startswith(precision) for r in results), results[0]["effective"]
    items = assemble([r["shards"] for r in results], ITEM_KEY, expected)
    update, expected_update = items - initial, expected - initial
    error = float((update - expected_update).abs().max() / expected_update.abs().max())
    assert error < tolerance, error
    assert not torch.equal(items, expected)  # quantized: not the fp32 result bit for bit
    assert torch.equal(items[expected_update == 0], initial[expected_update == 0])  # untouched rows stay untouched
