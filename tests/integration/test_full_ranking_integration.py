"""The sharded full ranking equals the unsharded brute force (``UnshardedItemRanking``), test for test.

One ``EmbeddingCollection`` holds a table per sharding type (table-wise, row-wise, column-wise), each once
with random floats (ties improbable) and once with planted exact ties, and is sharded with
``shard_model`` on 2 processes (1D) and on 4 processes as 2 sharding groups of 2 (2D). Every rank ranks its
own users (different users and batch sizes on every rank, an empty batch on one rank, an empty group),
with row chunks smaller than a shard and with the default, with and without ``normalize_rows``; the
parent ranks each rank's users with the reference over the whole table and compares. Also: one process
holding every column slice of a table (gloo), one GPU under nccl with a data-parallel table (``gpu``), and
``TwoDRecStrategy.item_ranking`` on a fitted model's column-wise item table.
"""

from __future__ import annotations

import functools
import zlib
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks
from torch import nn
from torch.overrides import TorchFunctionMode
from torchrec import EmbeddingCollection, EmbeddingConfig

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, make_sharders, shard_model
from lightning_recsys.parallel.ranking import DEFAULT_CHUNK_ROWS, ShardedItemRanking, UnshardedItemRanking, make_item_ranking

NUM_ITEMS, DIM = 37, 8  # odd rows: uneven row-wise shards
# Placements are group-local ranks. Column-wise: the first half of the columns on group rank 1, the second on 0;
# and both halves on group rank 1 (as table-wise-column-wise places them): rank 0 holds none of it, yet scores rows.
FUSED = EmbeddingComputeKernel.FUSED.value  # as the planner picks: FBGEMM's kernel, the optimizer in backward
PLACEMENTS = {
    "random_tw": table_wise(rank=1, compute_kernel=FUSED),
    "ties_tw": table_wise(rank=0, compute_kernel=FUSED),
    "random_rw": row_wise(compute_kernel=FUSED),
    "ties_rw": row_wise(compute_kernel=FUSED),
    "random_cw": column_wise(ranks=[1, 0], compute_kernel=FUSED),
    "ties_cw": column_wise(ranks=[1, 1], compute_kernel=FUSED),
}
# One process on one device: the column slices both on it (still put together by the all-to-all); data_parallel
# runs for sequence tables on CUDA only (RecSysEmbeddingCollectionSharder), so it joins there.
ONE_DEVICE = {
    "random_tw": table_wise(rank=0, compute_kernel=FUSED),
    "random_rw": row_wise(compute_kernel=FUSED),
    "random_cw": column_wise(ranks=[0, 0], compute_kernel=FUSED),
    "ties_cw": column_wise(ranks=[0, 0], compute_kernel=FUSED),
}
CUDA_ONLY = {"random_dp": data_parallel()}
LAYOUTS = {"two_ranks": PLACEMENTS, "one_device": ONE_DEVICE, "one_cuda_device": {**ONE_DEVICE, **CUDA_ONLY}}
LOCAL_SHARDS = {"random_tw": [0, 1], "ties_tw": [1, 0], "random_rw": [1, 1], "ties_rw": [1, 1], "random_cw": [1, 1], "ties_cw": [0, 2]}
TABLES = list(PLACEMENTS)
SCENARIOS = ("uneven", "one_empty", "all_empty")
CHUNKS = (3, DEFAULT_CHUNK_ROWS)  # 3: several chunks per shard (and a last chunk shorter than the group)
K_SMALL, K_LARGE = 4, NUM_ITEMS + 5  # K_LARGE: more than the table; seen items fill the list at -inf


def table_values(name: str) -> torch.Tensor:
    """Random floats, or planted ties: every row has four entries of +-1 (norm 2, so normalised rows are
    exact halves) and many rows repeat, so scores are exact and many equal the target's."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.startswith("random"):
        return torch.randn(NUM_ITEMS, DIM, generator=generator)
    patterns = torch.zeros(6, DIM)
    for row in patterns:
        columns = torch.randperm(DIM, generator=generator)[:4]
        row[columns] = torch.randint(0, 2, (4,), generator=generator).float() * 2 - 1
    return patterns[torch.randint(0, 6, (NUM_ITEMS,), generator=generator)]


def batch_size(scenario: str, rank: int) -> int:
    return {"uneven": 2 + 3 * rank, "one_empty": 0 if rank == 1 else 4, "all_empty": 0}[scenario]


def rank_inputs(table: str, scenario: str, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s users: queries, targets, seen ids (some users see nothing, some saw their target)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{table} {scenario} {rank}".encode()))
    batch = batch_size(scenario, rank)
    if table.startswith("random"):
        queries = torch.randn(batch, DIM, generator=generator)
    else:
        queries = torch.randint(-2, 3, (batch, DIM), generator=generator).float()
    targets = torch.randint(0, NUM_ITEMS, (batch,), generator=generator)
    seen_lengths = torch.randint(0, 7, (batch,), generator=generator)
    seen_ids = torch.randint(0, NUM_ITEMS, (int(seen_lengths.sum()),), generator=generator)
    if batch and seen_lengths[0] > 0:
        seen_ids[0] = targets[0]  # a seen target is still ranked
    return {"queries": queries, "target_ids": targets, "seen_ids": seen_ids, "seen_lengths": seen_lengths}


class _Model(nn.Module):
    def __init__(self, tables: list[str]) -> None:
        super().__init__()
        configs = [EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=NUM_ITEMS, feature_names=[f"f_{t}"]) for t in tables]
        self.item_embeddings = EmbeddingCollection(tables=configs)
        with torch.no_grad():
            for name in tables:
                self.item_embeddings.embeddings[name].weight.copy_(table_values(name))


def _sharded_collection(
    rank: int, world_size: int, group_size: int, layout: str, device: torch.device
) -> tuple[nn.Module, ParallelTopology]:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60),
        device_id=device if device.type == "cuda" else None,
    )
    topology = ParallelTopology(world_size=world_size, sharding_group_size=group_size)
    topology.device_mesh(device.type)
    placements = LAYOUTS[layout]
    model = _Model(list(placements))
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd", lr=0.1).fused_params())
    module_plan = construct_module_sharding_plan(
        model.item_embeddings, placements, sharder=sharders[1], local_size=group_size, world_size=group_size, device_type=device.type
    )
    plan = ShardingPlan({"item_embeddings": module_plan})
    sharded = shard_model(model, topology=topology, device=device, sharders=sharders, plan=plan)
    return sharded.dmp.module.item_embeddings, topology


class _ScoreColumns(TorchFunctionMode):
    """The widest matrix product (score block: queries x rows) computed inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func in (torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.widest = max(self.widest, result.shape[-1])
        return result


def _rank_everything(rank: int, world_size: int, group_size: int, layout: str = "two_ranks", device_type: str = "cpu") -> dict[str, Any]:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collection, topology = _sharded_collection(rank, world_size, group_size, layout, device)
    group = topology.sharding_process_group()
    tables = list(LAYOUTS[layout])
    results: dict[Any, Any] = {}
    widest: dict[tuple[str, int], int] = {}  # the most rows one score block held
    for table in tables:
        for scenario in SCENARIOS:
            inputs = {name: value.to(device) for name, value in rank_inputs(table, scenario, rank).items()}
            seen = (inputs["seen_ids"], inputs["seen_lengths"])
            for chunk_rows in CHUNKS:
                for normalize in (False, True):
                    ranking = make_item_ranking(collection, table, process_group=group, chunk_rows=chunk_rows, normalize_rows=normalize)
                    assert isinstance(ranking, ShardedItemRanking)
                    with _ScoreColumns() as score_columns:
                        ranks = ranking.target_ranks(inputs["queries"], inputs["target_ids"], *seen)
                        small = ranking.top_k(inputs["queries"], K_SMALL, *seen)
                        large = ranking.top_k(inputs["queries"], K_LARGE, *seen)
                    results[(table, scenario, chunk_rows, normalize)] = (
                        ranks.cpu(), tuple(t.cpu() for t in small), tuple(t.cpu() for t in large)
                    )
                    widest[(table, chunk_rows)] = max(widest.get((table, chunk_rows), 0), score_columns.widest)
    state = collection.state_dict()
    shard_counts = {t: len(state[f"embeddings.{t}.weight"].local_shards()) for t in tables if t not in CUDA_ONLY}
    wrong_group = None
    if not topology.is_1d:  # the world under 2D spans both replicas: every rank must refuse, none may hang
        inputs = rank_inputs("random_rw", "uneven", rank)
        try:
            ShardedItemRanking(collection, "random_rw", dist.group.WORLD).target_ranks(**inputs)
        except ValueError as error:
            wrong_group = str(error)
    bad_input = None
    if layout == "two_ranks":  # rank 1 alone names a target outside the table: both ranks raise, neither waits
        inputs = rank_inputs("random_cw", "uneven", rank)
        if rank == 1:
            inputs["target_ids"][0] = NUM_ITEMS
        try:
            ShardedItemRanking(collection, "random_cw", group).target_ranks(**inputs)
        except ValueError as error:
            bad_input = str(error)
    return {"results": results, "shard_counts": shard_counts, "wrong_group": wrong_group, "widest": widest, "bad_input": bad_input}


@functools.cache
def _expected(table: str, scenario: str, rank: int, normalize: bool) -> tuple[torch.Tensor, tuple, tuple]:
    inputs = rank_inputs(table, scenario, rank)
    reference = UnshardedItemRanking(table_values(table), normalize_rows=normalize)
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    return (
        reference.target_ranks(inputs["queries"], inputs["target_ids"], *seen),
        reference.top_k(inputs["queries"], K_SMALL, *seen),
        reference.top_k(inputs["queries"], K_LARGE, *seen),
    )


def _assert_equal_to_reference(outputs: list[dict[str, Any]], table: str) -> None:
    for rank, output in enumerate(outputs):
        for scenario in SCENARIOS:
            for chunk_rows in CHUNKS:
                for normalize in (False, True):
                    ranks, small, large = output["results"][(table, scenario, chunk_rows, normalize)]
                    expected_ranks, expected_small, expected_large = _expected(table, scenario, rank, normalize)
                    where = f"rank {rank}, {scenario}, chunk_rows={chunk_rows}, normalize_rows={normalize}"
                    assert ranks.shape == (batch_size(scenario, rank),), where
                    assert torch.equal(ranks, expected_ranks), f"{where}: {ranks} != {expected_ranks}"
                    pairs = ((small, expected_small, K_SMALL), (large, expected_large, K_LARGE))
                    for (scores, ids), (expected_scores, expected_ids), k in pairs:
                        assert ids.shape == (batch_size(scenario, rank), min(k, NUM_ITEMS)), where
                        assert torch.equal(ids, expected_ids), f"{where}, k={k}: {ids} != {expected_ids}"
                        # A matrix product's last bit depends on its shape (BLAS blocking), here as between two chunk_rows
                        # of the reference; the planted ties are small integers and halves: exact whatever the order.
                        exact = {"rtol": 0, "atol": 0} if table.startswith("ties") else {}
                        torch.testing.assert_close(scores, expected_scores, msg=where, **exact)


@pytest.fixture(scope="module")
def one_d() -> list[dict[str, Any]]:
    return run_ranks(_rank_everything, 2, 2, timeout=240)


@pytest.fixture(scope="module")
def two_d() -> list[dict[str, Any]]:
    return run_ranks(_rank_everything, 4, 2, timeout=300)


@pytest.mark.parametrize("table", TABLES)
def test_sharded_ranking_equals_brute_force_on_2_processes(one_d: list[dict[str, Any]], table: str) -> None:
    _assert_equal_to_reference(one_d, table)


@pytest.mark.slow
@pytest.mark.parametrize("table", TABLES)
def test_sharded_ranking_equals_brute_force_under_2d_2x2(two_d: list[dict[str, Any]], table: str) -> None:
    _assert_equal_to_reference(two_d, table)


@pytest.mark.slow
def test_the_world_group_under_2d_is_refused_on_every_rank(two_d: list[dict[str, Any]]) -> None:
    assert all("sharding group" in (output["wrong_group"] or "") for output in two_d), [o["wrong_group"] for o in two_d]


@pytest.fixture(scope="module")
def one_process() -> list[dict[str, Any]]:
    return run_ranks(_rank_everything, 1, 1, "one_device", "cpu", timeout=120)


@pytest.mark.parametrize("table", list(ONE_DEVICE))
def test_one_process_puts_its_own_column_slices_together(one_process: list[dict[str, Any]], table: str) -> None:
    _assert_equal_to_reference(one_process, table)


@pytest.mark.gpu
def test_sharded_ranking_on_cuda_with_nccl_equals_brute_force() -> None:
    # One GPU is one rank under nccl: every table kind (data_parallel too) through the nccl collectives on CUDA tensors.
    outputs = run_ranks(_rank_everything, 1, 1, "one_cuda_device", "cuda", timeout=300)
    for table in LAYOUTS["one_cuda_device"]:
        _assert_equal_to_reference(outputs, table)


def test_a_bad_input_on_one_rank_stops_every_rank_of_the_group(one_d: list[dict[str, Any]]) -> None:
    assert "group rank(s) [1]" in (one_d[0]["bad_input"] or ""), one_d[0]["bad_input"]
    assert f"target_ids contains [{NUM_ITEMS}], outside the table's rows" in (one_d[1]["bad_input"] or ""), one_d[1]["bad_input"]


def test_no_score_block_is_wider_than_chunk_rows(one_d: list[dict[str, Any]]) -> None:
    for table in TABLES:
        widest = [output["widest"][(table, 3)] for output in one_d]  # 0 on a rank that holds none of a table-wise table
        assert max(widest) == 3, (table, widest)  # never [queries x all rows]
        assert max(output["widest"][(table, DEFAULT_CHUNK_ROWS)] for output in one_d) <= NUM_ITEMS


def test_the_tables_are_sharded_as_planned(one_d: list[dict[str, Any]]) -> None:
    assert {t: [output["shard_counts"][t] for output in one_d] for t in TABLES} == LOCAL_SHARDS


def test_planted_ties_make_the_pessimistic_rule_matter() -> None:
    # Had the tie tables no ties with the target, the tie rule would go untested.
    broken_ties = 0
    for name in [t for t in TABLES if t.startswith("ties")]:
        table = table_values(name)
        for rank in range(4):
            inputs = rank_inputs(name, "uneven", rank)
            scores = inputs["queries"] @ table.T
            target = scores.gather(1, inputs["target_ids"][:, None])
            broken_ties += int(((scores == target).sum(1) > 1).sum())
    assert broken_ties > 10


def _fit_then_rank_through_the_strategy(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_recsys.testing.oracle.sequence import DIM, ITEMS, fit_sharded, make_model, sgd_strategy, table_shards

    model, trainer, _ = fit_sharded(rank, world_size, sgd_strategy(sharding_types=["column_wise"]), steps=1)
    ranking = trainer.strategy.item_ranking(model.sequence_embeddings, "item", normalize_rows=True, chunk_rows=5)
    generator = torch.Generator().manual_seed(rank)
    batch = 3 + 2 * rank
    inputs = {
        "queries": torch.randn(batch, DIM, generator=generator),
        "target_ids": torch.randint(0, ITEMS, (batch,), generator=generator),
        "seen_ids": torch.randint(0, ITEMS, (batch,), generator=generator),
        "seen_lengths": torch.ones(batch, dtype=torch.long),
    }
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    return {
        "sharded": isinstance(ranking, ShardedItemRanking),
        "inputs": inputs,
        "ranks": ranking.target_ranks(**inputs),
        "top_k": ranking.top_k(inputs["queries"], 6, *seen),
        "shards": table_shards(model),
        "initial": make_model().state_dict()["sequence_embeddings.embeddings.item.weight"],
    }


def test_the_strategy_ranks_the_trained_sharded_table_of_a_fitted_model() -> None:
    from lightning_recsys.testing.oracle import assemble
    from lightning_recsys.testing.oracle.sequence import ITEM_KEY

    outputs = run_ranks(_fit_then_rank_through_the_strategy, 2, timeout=300)
    table = assemble([o["shards"] for o in outputs], ITEM_KEY, outputs[0]["initial"])
    assert not torch.equal(table, outputs[0]["initial"])  # trained: the ranking must read the table as it is now
    for output in outputs:
        assert output["sharded"]
        inputs = output["inputs"]
        reference = UnshardedItemRanking(table, normalize_rows=True)
        assert torch.equal(output["ranks"], reference.target_ranks(**inputs))
        scores, ids = reference.top_k(inputs["queries"], 6, inputs["seen_ids"], inputs["seen_lengths"])
        assert torch.equal(output["top_k"][1], ids)
        torch.testing.assert_close(output["top_k"][0], scores)
