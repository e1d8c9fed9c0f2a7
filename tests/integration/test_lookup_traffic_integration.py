"""The sequence all-to-all's split by feature (history, targets, negatives, actions) sums to the measured payload.

Two processes as two "nodes" (gloo), SequencePretrainer's item table (``item_id``, ``next_item_id``,
``negative_item_id``) and action table: at every training step, the split's embeddings and gradients summed
over the ranks equal the ``embeddings`` all-to-all bytes the accountant measured on them, in total and across
nodes, with and without index dedup and QComms.
"""

from __future__ import annotations

import pytest
from lightning.pytorch import Callback
from lightning_recsys.testing.processes import run_ranks
from summary_helpers import summary_rows
from lightning.pytorch import Trainer
from lightning_recsys.testing.oracle.pretrain import STEPS, PretrainDataModule, make_model, sgd_strategy

from lightning_recsys import QCommsConfig
from lightning_recsys.callbacks import RunSummary, format_summary

WORLD_SIZE = 2
FEATURES = ("item_id", "next_item_id", "negative_item_id", "action")


class _RecordSplit(Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        accounting = trainer.strategy.comm_accounting
        self.steps.append({
            "measured": accounting.bytes_by(purpose="embeddings", op="all_to_all"),
            "split": accounting.lookup_split(),
        })


def _fit(rank: int, world_size: int, sharding_type: str, qcomms: str, dedup: bool) -> dict:
    record, summary = _RecordSplit(), RunSummary(warmup_steps=1)
    config = QCommsConfig.preset(qcomms)
    qcomms_config = QCommsConfig(forward=config.forward, backward=config.backward, index_dedup=dedup)
    # 1D: the all-to-all spans both "nodes".
    strategy = sgd_strategy(sharding_types=[sharding_type], qcomms=qcomms_config, sharding_group_size=world_size)
    trainer = Trainer(  # one process per "node": every peer is on the other node
        accelerator="cpu", devices=1, num_nodes=world_size, strategy=strategy, max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record, summary],
    )
    trainer.fit(make_model(), datamodule=PretrainDataModule())
    assert set(record.steps[-1]["split"]) == set(FEATURES), record.steps[-1]
    return {"steps": record.steps, "summary": summary_rows(format_summary(summary.summary))}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding_type", "qcomms", "dedup"),
    [("row_wise", "fp32", False), ("row_wise", "fp8", True), ("column_wise", "bf16", True), ("table_wise", "fp32", True)],
)
def test_split_by_feature_sums_to_the_measured_all_to_all(sharding_type: str, qcomms: str, dedup: bool) -> None:
    outputs = run_ranks(_fit, WORLD_SIZE, sharding_type, qcomms, dedup, timeout=300, ranks_per_node=1)
    results = [output["steps"] for output in outputs]
    assert all(len(steps) == STEPS for steps in results)
    # The run summary shows the last step's split: embeddings in + gradients out (inter-node) per feature.
    last = results[0][-1]["split"]
    for feature in FEATURES:
        parts = last[feature]
        expected = f"{parts['embeddings'][0]:,} + {parts['gradients'][0]:,} ({parts['embeddings'][1] + parts['gradients'][1]:,})"
        assert outputs[0]["summary"][feature] == expected, (feature, outputs[0]["summary"])
    for step in range(STEPS):
        per_rank = [steps[step] for steps in results]
        measured = [sum(r["measured"][i] for r in per_rank) for i in (0, 1)]
        split = [sum(parts[d][i] for r in per_rank for parts in r["split"].values() for d in parts) for i in (0, 1)]
        assert measured[0] > 0 and measured[1] > 0, measured  # two nodes: some rows cross
        assert split == measured, (step, split, measured)
        item = [r["split"]["item_id"]["embeddings"][0] for r in per_rank]
        targets = [r["split"]["next_item_id"]["embeddings"][0] for r in per_rank]
        if dedup:  # a target is the next history item: deduped, only each example's last one is new
            assert sum(targets) < sum(item) / 2, (targets, item)
        else:  # one target per input item
            assert targets == item
        for r in per_rank:
            forward, backward = r["split"]["item_id"]["embeddings"][0], r["split"]["item_id"]["gradients"][0]
            assert forward == backward  # one precision both ways here (fp8's e4m3 and e5m2 are both one byte)


def _validate(rank: int, world_size: int) -> dict:
    from lightning_recsys.testing.oracle.pretrain import DIM

    strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=world_size)
    trainer = Trainer(accelerator="cpu", devices=1, num_nodes=world_size, strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    data = PretrainDataModule()
    trainer.validate(make_model(), datamodule=data)
    (batch,) = list(data._dataset("val", rank, world_size))
    measured = {op: trainer.strategy.comm_accounting.bytes_by(purpose="ranking", op=op, step="total")[0] for op in ("all_gather", "all_reduce")}
    return {"measured": measured, "batch": int(batch.seen_lengths.numel()), "seen": int(batch.seen_ids.numel()), "dim": DIM}


@pytest.mark.slow
def test_the_full_ranking_exchange_is_filed_under_ranking_and_matches_the_cost_model():
    from lightning_recsys.planner.cost import ranking_eval_traffic

    results = run_ranks(_validate, WORLD_SIZE, timeout=300, ranks_per_node=1)
    # The exchange pads every rank's tensors to the group's largest batch and seen count.
    batch, seen = max(r["batch"] for r in results), max(r["seen"] for r in results)
    assert all(r["batch"] == batch for r in results)
    expected = {c.op: c.payload_bytes for c in ranking_eval_traffic(batch_per_rank=batch, dim=results[0]["dim"], seen_per_example=seen / batch,
                                                                     group_size=WORLD_SIZE)}  # fmt: skip
    for r in results:
        assert r["measured"] == pytest.approx(expected), (r["measured"], expected)
