"""Embedding weight decay follows one rule whatever a table's sharding type (gloo; CUDA where marked).

The rule is FBGEMM's L2 decay (``WeightDecayMode.L2``) on the rows looked up in the step, with the
decay term inside row-wise Adagrad's accumulator. The reference below applies it to the unsharded
oracle model on the global batches, with the exact set of looked-up ids (the data-parallel
optimizer reads "looked up" off the gradient instead).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.click import CONFIG, DENSE_LR, EMBEDDING_LR, STEPS, TABLE_KEY, fit_sharded, make_model, shards_of
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import EmbeddingOptimizerConfig, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLog
from lightning_recsys.planner import plan_rows
from lightning_recsys.planner.config import PlanningConfig

WEIGHT_DECAY = 0.5  # large, so that decay on the wrong rows is far outside assert_close's tolerance
EPS = 1e-8


def _config() -> EmbeddingOptimizerConfig:
    return EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=EMBEDDING_LR, eps=EPS, weight_decay=WEIGHT_DECAY)


def train_unsharded_with_l2_on_looked_up_rows() -> tuple[dict[str, torch.Tensor], dict[str, set[int]]]:
    """Dense SGD, and for every table FBGEMM's row-wise Adagrad with L2 on the ids of the global batch."""
    model = make_model()
    tables = {n: p for n, p in model.named_parameters() if "embedding_bags" in n}
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "embedding_bags" not in n], lr=DENSE_LR)
    sums = {n: torch.zeros(p.shape[0], 1) for n, p in tables.items()}
    log, looked_up = SyntheticClickLog(CONFIG), {n: set() for n in tables}
    for step in range(STEPS):
        batch = log.global_batch("train", step)
        dense.zero_grad()
        for p in tables.values():
            p.grad = None
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
        dense.step()
        with torch.no_grad():
            for name, weight in tables.items():
                feature = name.split(".")[-2].removeprefix("t_")
                rows = torch.unique(batch.sparse[feature].values())
                looked_up[name] |= set(rows.tolist())
                grad = weight.grad[rows] + WEIGHT_DECAY * weight[rows]
                sums[name][rows] += grad.pow(2).mean(dim=1, keepdim=True)
                weight[rows] -= EMBEDDING_LR * grad / (sums[name][rows].sqrt() + EPS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, looked_up


def _train(rank: int, world_size: int, sharding_type: str, accelerator: str) -> dict:
    strategy = TwoDRecStrategy(embedding_optimizer=_config(), planning=PlanningConfig(sharding_types=[sharding_type]), process_group_timeout=60)
    model, trainer, _ = fit_sharded(rank, world_size, strategy, accelerator=accelerator)
    return {"shards": shards_of(model), "plan": plan_rows(strategy.sharded_model.plan), "steps": trainer.global_step}


def _check(sharding_type: str, world_size: int, accelerator: str, **tolerances: float) -> None:
    expected, looked_up = train_unsharded_with_l2_on_looked_up_rows()
    results = run_ranks(_train, world_size, sharding_type, accelerator, timeout=240)
    assert all(r["steps"] == STEPS for r in results)
    assert {row["sharding_type"] for row in results[0]["plan"]} == {sharding_type}
    initial = make_model().state_dict()
    untouched_rows = 0
    for key, want in expected.items():
        if "embedding_bags" not in key:
            continue
        got = assemble([r["shards"] for r in results], key, want)
        torch.testing.assert_close(got, want, msg=lambda m: f"{key}: {m}", **tolerances)
        untouched = sorted(set(range(want.shape[0])) - looked_up[key])
        # Rows never looked up keep their initial values exactly: no decay, no accumulator.
        assert torch.equal(got[untouched], initial[key][untouched]), f"{key}: rows never looked up moved"
        untouched_rows += len(untouched)
    assert untouched_rows > 0, "every row was looked up, so the test cannot tell the rules apart"
    assert not torch.allclose(initial[TABLE_KEY], expected[TABLE_KEY])


def test_data_parallel_tables_decay_only_the_looked_up_rows_as_fbgemm_does() -> None:
    _check("data_parallel", 2, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("sharding_type", ["table_wise", "data_parallel"])
def test_the_same_table_decays_alike_planned_table_wise_or_data_parallel_on_cuda(sharding_type: str) -> None:
    # FBGEMM's CUDA kernel applies WeightDecayMode.L2 (its CPU kernel, in fbgemm-gpu-cpu 1.8.0, does not,
    # and the config refuses weight decay for model-parallel tables on CPU). Both plans match one reference.
    _check(sharding_type, min(2, torch.cuda.device_count()), "gpu", rtol=1e-4, atol=1e-5)
