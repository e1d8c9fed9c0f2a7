"""SequencePretrainer(encoder=HSTUEncoder) under TwoDRecStrategy (gloo): 1D on 2 processes and 2D on 2 x 2 train as
unsharded SGD does on the same global batches (the pretrainer's oracle), with HSTU in place of SASRec."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.pretrain import ITEM_KEY, STEPS, fit_sharded, is_table, make_model, sgd_strategy, table_shards, train_unsharded
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import ReplicaSyncConfig
from lightning_recsys.models.encoders import HSTUEncoder

# The oracle's model with HSTU as its encoder (its SASRec shorthand cleared: options go to the encoder).
HSTU = dict(encoder=partial(HSTUEncoder, num_layers=2, num_heads=2, dropout=0.0), num_layers=None, num_heads=None, dropout=None)
PER_NODE, NODES = 2, 2


def _state(model: torch.nn.Module) -> dict:
    return {"shards": table_shards(model), "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if not is_table(k)}}


def _fit_1d(rank: int, world_size: int) -> dict:
    model = make_model(**HSTU)
    _, trainer, _ = fit_sharded(rank, world_size, sgd_strategy(sharding_types=["row_wise"]), model=model)
    assert trainer.global_step == STEPS
    return _state(model)


def _fit_2d(rank: int, world_size: int) -> dict:
    model = make_model(**HSTU)
    strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=ReplicaSyncConfig(rows="touched"))
    _, trainer, _ = fit_sharded(rank, world_size, strategy, model=model, devices=PER_NODE, num_nodes=NODES)
    assert trainer.global_step == STEPS
    return _state(model)


def _equals_oracle(results: list[dict], group: range, expected: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        if is_table(key):
            torch.testing.assert_close(assemble([results[r]["shards"] for r in group], key, value), value, msg=lambda m: f"{key}: {m}")
        else:
            for rank, result in enumerate(results):
                torch.testing.assert_close(result["dense"][key], value, msg=lambda m: f"rank {rank} {key}: {m}")
    assert not torch.allclose(expected[ITEM_KEY], make_model(**HSTU).state_dict()[ITEM_KEY])  # it trained
    assert not torch.allclose(expected["encoder.position_bias"], torch.zeros_like(expected["encoder.position_bias"]))


def test_hstu_pretrains_under_1d_as_unsharded_sgd_does():
    results = run_ranks(_fit_1d, 2, timeout=300)
    _equals_oracle(results, range(2), train_unsharded(2, **HSTU).state)


@pytest.mark.slow
def test_hstu_pretrains_under_2d_with_a_sync_every_step_as_unsharded_sgd_does():
    # 2D with SGD and a blocking touched-row sync after every step is unsharded SGD on the global batches.
    results = run_ranks(_fit_2d, PER_NODE * NODES, timeout=400, ranks_per_node=PER_NODE)
    _equals_oracle(results, range(PER_NODE), train_unsharded(PER_NODE * NODES, **HSTU).state)
