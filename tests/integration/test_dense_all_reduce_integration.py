"""The dense gradients' two-stage all-reduce (2D, gloo, across nodes): 4 processes as 2 nodes x 2."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from lightning_recsys.testing.oracle.click import fit_sharded, sgd_strategy
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import QCommsConfig, ReplicaSyncConfig

pytestmark = pytest.mark.slow


class _DenseTraffic(Callback):
    def __init__(self) -> None:
        self.groups: list[tuple[str, bool]] = []  # (group, spans nodes) of each step's dense-gradient collectives

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for key in trainer.strategy.comm_accounting.last_step:
            if key.purpose == "dense_grads":
                self.groups.append((key.group, key.spans_nodes))


def _fit(rank: int, world_size: int, ranks_per_node: int, dense_grads: str) -> dict:
    traffic = _DenseTraffic()
    strategy = sgd_strategy(sharding_group_size=2, replica_sync=ReplicaSyncConfig(every_n_steps=1), qcomms=QCommsConfig(dense_grads=dense_grads))
    model, _, predictions = fit_sharded(
        rank, world_size, strategy, devices=ranks_per_node, num_nodes=world_size // ranks_per_node, callbacks=[traffic]
    )
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if "embedding" not in n}
    return {"dense": dense, "predictions": predictions, "groups": sorted(set(traffic.groups)), "staged": strategy.sharded_model.dense_all_reduce_staged}


@pytest.mark.parametrize("dense_grads", ["fp32", "bf16"])
def test_two_nodes_reduce_inside_each_node_then_across_and_match_the_flat_all_reduce(dense_grads: str) -> None:
    staged = run_ranks(_fit, 4, 2, dense_grads, timeout=300, ranks_per_node=2)
    flat = run_ranks(_fit, 4, 4, dense_grads, timeout=300, ranks_per_node=4)  # one node: gloo's flat ring
    assert all(r["staged"] for r in staged) and not any(r["staged"] for r in flat)
    for r in staged:  # inside the node (the sharding group here), then across nodes (the replica group)
        assert r["groups"] == [("replicate", True), ("shard", False)], r["groups"]
    assert all(r["groups"] == [("world", False)] for r in flat)
    for name, value in staged[0]["dense"].items():
        for rank, other in enumerate(staged[1:], start=1):
            assert torch.equal(other["dense"][name], value), f"rank {rank} holds another {name}"
        # The same sum in another order: rounding apart, the flat all-reduce's weights.
        tolerance = {} if dense_grads == "fp32" else {"rtol": 1e-2, "atol": 1e-3}
        torch.testing.assert_close(value, flat[0]["dense"][name], **tolerance)
    for s, f in zip(staged, flat):
        torch.testing.assert_close(s["predictions"], f["predictions"], **({} if dense_grads == "fp32" else {"rtol": 1e-2, "atol": 1e-3}))
