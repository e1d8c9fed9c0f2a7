"""SequencePretrainer everywhere the DLRM runs (issue 41): 2D with replica sync and QComms, checkpoints resharded,
resumed, evaluated and exported, and the sequence DataModules' evaluation batches on several ranks (gloo)."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from oracle import assemble
from pretrain_oracle import (
    ITEM_KEY, STEPS, fit_two_d, is_table, make_model, sgd_strategy, table_shards, train_two_replicas, train_unsharded,
)

from lightning_recsys import QCommsConfig, ReplicaSyncConfig

# ----------------------------------------------------------------- 2D: 2 nodes x 2 processes
WORLD, PER_NODE, NODES = 4, 2, 2
PARTNER = {0: 2, 1: 3, 2: 0, 3: 1}  # a sharding group per node; the replica of rank r is rank r + 2 (mod 4)
FP8_DIM = 16  # fp8 scales blocks of 8 or 16 values (at 4 it runs as bf16)
# One step's largest table-update error relative to the largest update; the 1D fp8 test's bound (about 2x the
# measured error, fp8 e4m3/e5m2 keeping 4/3 significant bits, amplified by the softmax at temperature 0.5).
FP8_TOLERANCE = 1e-1


def _fit_2d(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, overlap in (("blocking", False), ("overlapped", True)):
        model = make_model()
        strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=ReplicaSyncConfig(overlap=overlap))
        trainer = fit_two_d(strategy, model, devices=PER_NODE, num_nodes=NODES)
        assert trainer.global_step == STEPS
        out[name] = {"shards": table_shards(model), "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if not is_table(k)}}
    model = make_model(embedding_dim=FP8_DIM)
    strategy = sgd_strategy(
        sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=ReplicaSyncConfig(),
        qcomms=QCommsConfig(forward="fp8", backward="fp8"),
    )
    fit_two_d(strategy, model, devices=PER_NODE, num_nodes=NODES, steps=1)
    out["fp8"] = {"shards": table_shards(model), "effective": strategy.effective_qcomms.precisions["sequence_all_to_all"]}
    return out


@pytest.fixture(scope="module")
def two_d_runs() -> list[dict]:
    return run_ranks(_fit_2d, WORLD, timeout=400, ranks_per_node=PER_NODE)


def _replicas_identical(results: list[dict], name: str) -> None:
    for rank, partner in PARTNER.items():
        mine, theirs = results[rank][name]["shards"], results[partner][name]["shards"]
        assert mine.keys() == theirs.keys()
        for key in mine:
            for (offsets, value), (other_offsets, other) in zip(mine[key], theirs[key], strict=True):
                assert offsets == other_offsets and torch.equal(value, other), f"{name}: rank {rank} and {partner} differ in {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name, overlap", [("blocking", False), ("overlapped", True)])
def test_2d_touched_row_sync_every_step_equals_the_unsharded_oracle(two_d_runs, name, overlap):
    """Blocking: 2D with SGD and a sync every step IS unsharded SGD on the global batches (1D's oracle).
    Overlapped: each average lands one step late; the oracle of two unsharded replicas does the same."""
    expected = train_two_replicas(PER_NODE, overlap=overlap)
    if not overlap:  # the two-replica oracle, synced at once, is 1D's oracle
        for key, value in train_unsharded(WORLD).items():
            torch.testing.assert_close(expected[key], value, msg=lambda m: f"{key}: {m}")
    else:  # the late averages matter: this case can tell overlapped from blocking
        assert not torch.allclose(expected[ITEM_KEY], train_unsharded(WORLD)[ITEM_KEY], atol=1e-3)
    _replicas_identical(two_d_runs, name)
    group = [two_d_runs[r][name]["shards"] for r in range(PER_NODE)]  # rank 0's sharding group holds a whole replica
    for key, value in expected.items():
        if is_table(key):
            torch.testing.assert_close(assemble(group, key, value), value, msg=lambda m: f"{key}: {m}")
        else:
            for rank in range(WORLD):
                torch.testing.assert_close(two_d_runs[rank][name]["dense"][key], value, msg=lambda m: f"rank {rank} {key}: {m}")
    assert not torch.allclose(expected[ITEM_KEY], make_model().state_dict()[ITEM_KEY])


@pytest.mark.slow
def test_2d_fp8_sequence_all_to_all_with_negatives_stays_within_fp8_tolerance(two_d_runs):
    expected = train_unsharded(WORLD, steps=1, embedding_dim=FP8_DIM)[ITEM_KEY]
    initial = make_model(embedding_dim=FP8_DIM).state_dict()[ITEM_KEY]
    assert all(r["fp8"]["effective"][0].startswith("fp8") for r in two_d_runs), two_d_runs[0]["fp8"]["effective"]
    _replicas_identical(two_d_runs, "fp8")
    items = assemble([two_d_runs[r]["fp8"]["shards"] for r in range(PER_NODE)], ITEM_KEY, expected)
    update, expected_update = items - initial, expected - initial
    error = float((update - expected_update).abs().max() / expected_update.abs().max())
    assert error < FP8_TOLERANCE, error
    assert not torch.equal(items, expected)  # quantized: not the fp32 result bit for bit
    assert torch.equal(items[expected_update == 0], initial[expected_update == 0])  # untouched rows stay untouched
