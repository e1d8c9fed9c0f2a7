"""Touched-row replica sync against whole-shard sync, with 4 processes as 2 nodes x 2 (gloo).

Two models from the same init train on the same batches, one synced with ``rows="all"``, one with
``rows="touched"``; after every step their tables and fused optimizer state must be bit-identical
(2 replicas) or close (4 replicas). Each model has an EmbeddingBagCollection (a 1000-row table that
a batch barely touches, and a small one) and an EmbeddingCollection (sequence) table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_recsys.testing.processes import run_ranks
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, make_sharders, shard_model
from lightning_recsys.parallel.comms.comm_accounting import CommAccountant
from lightning_recsys.parallel.sync.replica_sync import ReplicaSynchronizer
from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.planner import TableConstraints, make_sharding_plan

WORLD, PER_NODE = 4, 2
BAG_TABLES = (("big", 1000), ("small", 24))
SEQ_TABLES = (("seq", 60),)
DIM = 8
BATCH = 16  # global; 4 per rank
STEPS = 5

pytestmark = pytest.mark.slow


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in BAG_TABLES]
        )
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in SEQ_TABLES]
        )
        self.over = nn.Linear((len(BAG_TABLES) + len(SEQ_TABLES)) * DIM, 1)

    def forward(self, bags: KeyedJaggedTensor, seqs: KeyedJaggedTensor) -> torch.Tensor:
        pooled = [self.ebc(bags).values()]
        for name, _ in SEQ_TABLES:
            jt = self.ec(seqs)[f"f_{name}"]
            sample = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths())
            pooled.append(torch.zeros(jt.lengths().numel(), DIM).index_add(0, sample, jt.values()))
        return self.over(torch.cat(pooled, dim=1)).squeeze(-1)


def _kjt(tables: tuple[tuple[str, int], ...], g: torch.Generator, lo: int, hi: int) -> KeyedJaggedTensor:
    lengths = {n: torch.randint(1, 3, (BATCH,), generator=g) for n, _ in tables}
    ids = {n: [torch.randint(0, rows, (int(k),), generator=g) for k in lengths[n]] for n, rows in tables}
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n, _ in tables],
        values=torch.cat([torch.cat(ids[n][lo:hi]) for n, _ in tables]),
        lengths=torch.cat([lengths[n][lo:hi] for n, _ in tables]),
    )


def batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    local = BATCH // WORLD
    lo, hi = rank * local, (rank + 1) * local
    bags, seqs = _kjt(BAG_TABLES, g, lo, hi), _kjt(SEQ_TABLES, g, lo, hi)
    labels = torch.randint(0, 2, (BATCH,), generator=g).float()[lo:hi]
    return bags, seqs, labels


@dataclass
class Run:
    sharded: Any
    dense: torch.optim.Optimizer
    sync: ReplicaSynchronizer
    topology: ParallelTopology

    def train_step(self, rank: int, step: int) -> None:
        bags, seqs, labels = batch(step, rank)
        F.binary_cross_entropy_with_logits(self.sharded.dmp(bags, seqs), labels).backward()
        self.dense.step()
        self.dense.zero_grad(set_to_none=True)
        self.sync.step_ended()

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's local shards of the tables and of the fused optimizer state, by name and offsets."""
        out: dict[str, torch.Tensor] = {}
        for key, value in self.sharded.dmp.module.state_dict().items():
            if isinstance(value, ShardedTensor):
                for s in value.local_shards():
                    out[f"{key}@{tuple(s.metadata.shard_offsets)}"] = s.tensor.detach().clone()
        for key, states in self.sharded.fused_optimizer.state_dict()["state"].items():
            for name, value in states.items():
                if isinstance(value, ShardedTensor):
                    for s in value.local_shards():
                        out[f"{key}/{name}@{tuple(s.metadata.shard_offsets)}"] = s.tensor.detach().clone()
        return out


def build(rank: int, *, group_size: int, sharding_type: str, optimizer: str, sync: ReplicaSyncConfig) -> Run:
    topology = ParallelTopology(world_size=WORLD, sharding_group_size=group_size, ranks_per_node=PER_NODE)
    topology.device_mesh("cpu")
    torch.manual_seed(1234)
    model = Ranker()
    config = EmbeddingOptimizerConfig(name=optimizer, lr=0.3)
    sharders = make_sharders(config.fused_params(), [sharding_type])
    constraints = {
        n: TableConstraints(sharding_types=[sharding_type], min_partition=4 if sharding_type == "column_wise" else None)
        for n, _ in BAG_TABLES + SEQ_TABLES
    }
    plan = make_sharding_plan(
        model, sharders, sharding_group_size=group_size, group_ranks_per_node=group_size, compute_device="cpu", constraints=constraints
    )
    sharded = shard_model(model, topology=topology, device=torch.device("cpu"), sharders=sharders, plan=plan)
    dense = torch.optim.SGD([p for p in sharded.dmp.module.parameters() if not sharded.is_embedding_param(p)], lr=0.1)
    modules = [sharded.dmp.module.get_submodule(fqn) for fqn in sharded.embedding_module_fqns]
    synchronizer = ReplicaSynchronizer.for_sharded_modules(modules, sharded.fused_optimizer, topology.replica_process_group(), config=sync)
    synchronizer.broadcast_from_first_replica()
    return Run(sharded, dense, synchronizer, topology)


def _mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> list[str]:
    assert a.keys() == b.keys()
    bad = []
    for key in a:
        if exact and not torch.equal(a[key], b[key]):
            bad.append(f"{key}: {int((a[key] != b[key]).sum())} elements differ")
        elif not exact and not torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6):
            bad.append(f"{key}: not close")
    return bad


def _compare(rank: int, world: int, combos: list[tuple[str, str, int, int]], broken: bool = False) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if broken:  # drop the last row of the union: the equality check must catch it
        original = ReplicaSynchronizer._union

        def _union_missing_a_row(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            union, how, sent, counts = original(self, *args, **kwargs)
            return union[:-1], how, sent, counts

        ReplicaSynchronizer._union = _union_missing_a_row  # type: ignore[method-assign]
    out: dict = {}
    for sharding_type, optimizer, every, group_size in combos:
        runs = {
            rows: build(rank, group_size=group_size, sharding_type=sharding_type, optimizer=optimizer,
                        sync=ReplicaSyncConfig(rows=rows, every_n_steps=every))
            for rows in ("all", "touched")
        }
        assert runs["touched"].sync.tracks_rows
        exact = WORLD // group_size == 2
        mismatches: list[str] = []
        stats = []
        for step in range(STEPS):
            for run in runs.values():
                run.train_step(rank, step)
            mismatches += [f"step {step}: {m}" for m in _mismatches(runs["all"].state(), runs["touched"].state(), exact)]
            if runs["touched"].sync.steps_since_sync == 0:
                stats.append((runs["all"].sync.last_sync_stats, runs["touched"].sync.last_sync_stats))
        for run in runs.values():
            run.sync.sync_if_pending()
        mismatches += [f"end: {m}" for m in _mismatches(runs["all"].state(), runs["touched"].state(), exact)]
        # The states must have moved apart from the init and the optimizer state must be non-trivial.
        out[(sharding_type, optimizer, every, group_size)] = {"mismatches": mismatches, "stats": stats, "num_state": len(runs["all"].state())}
    return out


COMBOS = {
    sharding_type: [(sharding_type, optimizer, every, PER_NODE) for optimizer in ("sgd", "rowwise_adagrad") for every in (1, 3)]
    for sharding_type in ("table_wise", "row_wise", "column_wise")
}


@pytest.mark.parametrize("sharding_type", list(COMBOS))
def test_touched_row_sync_is_bit_identical_to_whole_shard_sync(sharding_type):
    results = run_ranks(_compare, WORLD, COMBOS[sharding_type], timeout=400, ranks_per_node=PER_NODE)
    for rank, result in enumerate(results):
        for combo, r in result.items():
            assert not r["mismatches"], f"rank {rank} {combo}: {r['mismatches'][:5]}"
            every = combo[2]
            assert len(r["stats"]) == STEPS // every  # syncs inside the steps (the last one is forced)
            for whole, touched in r["stats"]:
                assert whole.union == "all" and whole.rows_synced == whole.rows_total
                assert touched.rows_total == whole.rows_total
                assert 0 < touched.rows_synced < touched.rows_total


def test_touched_row_sync_is_close_to_whole_shard_sync_with_4_replicas():
    combos = [("table_wise", "rowwise_adagrad", 2, 1)]
    results = run_ranks(_compare, WORLD, combos, timeout=300, ranks_per_node=PER_NODE)
    for rank, result in enumerate(results):
        for combo, r in result.items():
            assert not r["mismatches"], f"rank {rank} {combo}: {r['mismatches'][:5]}"


def test_a_union_missing_one_row_is_caught():
    combos = [("row_wise", "rowwise_adagrad", 1, PER_NODE)]
    results = run_ranks(_compare, WORLD, combos, True, timeout=300, ranks_per_node=PER_NODE)
    assert any(r["mismatches"] for result in results for r in result.values())


def _bytes_per_sync(rank: int, world: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out = {}
    for rows in ("all", "touched"):
        run = build(rank, group_size=PER_NODE, sharding_type="table_wise", optimizer="sgd", sync=ReplicaSyncConfig(rows=rows, every_n_steps=1))
        topology = run.topology
        accountant = CommAccountant(topology, topology.sharding_process_group(), topology.replica_process_group())
        accountant.start()
        accountant.begin_step()
        run.train_step(rank, 0)
        accountant.end_step()
        accountant.stop()
        stats = run.sync.last_sync_stats
        out[rows] = {
            "accounted": accountant.bytes_by(purpose="replica_sync")[0],
            "payload_bytes": stats.payload_bytes,
            "rows_synced": stats.rows_synced,
            "rows_total": stats.rows_total,
            "union": stats.union,
            "whole_shard_bytes": run.sync.payload_bytes,
        }
    return out


def test_touched_row_sync_moves_bytes_by_rows_touched():
    results = run_ranks(_bytes_per_sync, WORLD, timeout=300, ranks_per_node=PER_NODE)
    for rank, r in enumerate(results):
        whole, touched = r["all"], r["touched"]
        print(f"rank {rank}: whole {whole} touched {touched}")
        assert whole["accounted"] == whole["payload_bytes"] == whole["whole_shard_bytes"]
        assert touched["accounted"] == touched["payload_bytes"]
        assert touched["rows_synced"] < touched["rows_total"]
        if whole["rows_total"] >= 1000:  # the rank holding the 1000-row table: a batch touches a few rows of it
            assert touched["rows_synced"] <= 2 * (BATCH * 2 + 16)
            assert touched["accounted"] * 10 < whole["accounted"], r
