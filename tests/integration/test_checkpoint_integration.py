"""DCP checkpoints with real processes (gloo): resharding chain, crash during save, mismatches, export.

The chain, each step a separate launch, with row-wise Adagrad state made non-zero by training:
4 ranks 2D (2x2) row_wise -> 2 ranks table_wise (t2 data_parallel, async save) -> 3 ranks
column_wise -> 4 ranks 2D row_wise. Every step compares the gathered tables and optimizer state
with the original, bit for bit. Table sizes 3 and 7 divide none of the world sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_recsys.testing.processes import run_ranks
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemWriter
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_recsys.checkpoint import (
    AsyncCheckpointSaver,
    CheckpointMismatchError,
    ShardedState,
    UncommittedCheckpointError,
    is_committed,
    latest_checkpoint,
    load_checkpoint,
    load_unsharded,
    read_meta,
    save_checkpoint,
)
from lightning_recsys.checkpoint.directory import temporary_path
from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, make_sharders, shard_model
from lightning_recsys.parallel.sync.replica_sync import ReplicaSynchronizer
from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.planner import TableConstraints, make_sharding_plan

TABLES: tuple[tuple[str, int], ...] = (("t0", 3), ("t1", 20), ("t2", 7))
DIM = 8
BATCH = 12  # divisible by 2, 3 and 4 ranks
STEPS = 3
LR = 0.1
EVAL_STEP = 99
PG_TIMEOUT = timedelta(seconds=60)

pytestmark = pytest.mark.slow

Pieces = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


class TinyRanker(nn.Module):
    def __init__(self, tables: tuple[tuple[str, int], ...] = TABLES) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in tables]
        )
        self.over = nn.Linear(len(tables) * DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.ebc(features).values()).squeeze(-1)


def make_model(seed: int, tables: tuple[tuple[str, int], ...] = TABLES) -> TinyRanker:
    torch.manual_seed(seed)
    return TinyRanker(tables)


def batch(step: int, lo: int = 0, hi: int = BATCH) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    lengths = {n: torch.randint(1, 3, (BATCH,), generator=g) for n, _ in TABLES}
    ids = {n: [torch.randint(0, rows, (int(k),), generator=g) for k in lengths[n]] for n, rows in TABLES}
    labels = torch.randint(0, 2, (BATCH,), generator=g).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n, _ in TABLES],
        values=torch.cat([torch.cat(ids[n][lo:hi]) for n, _ in TABLES]),
        lengths=torch.cat([lengths[n][lo:hi] for n, _ in TABLES]),
    )
    return kjt, labels[lo:hi]


@dataclass
class Run:
    rank: int
    world: int
    topology: ParallelTopology
    sharded: Any
    config: EmbeddingOptimizerConfig
    dp_optimizer: torch.optim.Optimizer | None
    dense_optimizer: torch.optim.Optimizer
    replica_sync: ReplicaSynchronizer | None

    def state(self) -> ShardedState:
        return ShardedState(
            model_state_dict=self.sharded.dmp.module.state_dict(),
            sharded_model=self.sharded,
            embedding_optimizer=self.config,
            data_parallel_table_optimizer=self.dp_optimizer,
        )

    def train_step(self, step: int) -> None:
        local = BATCH // self.world
        features, labels = batch(step, self.rank * local, (self.rank + 1) * local)
        F.binary_cross_entropy_with_logits(self.sharded.dmp(features), labels).backward()
        for optimizer in filter(None, (self.dense_optimizer, self.dp_optimizer)):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.replica_sync is not None:
            self.replica_sync.sync()

    def predict(self) -> torch.Tensor:
        local = BATCH // self.world
        with torch.no_grad():
            return self.sharded.dmp(batch(EVAL_STEP, self.rank * local, (self.rank + 1) * local)[0]).detach()


def init(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)


def build(
    rank: int,
    world: int,
    *,
    group_size: int,
    sharding_type: str,
    seed: int,
    data_parallel: tuple[str, ...] = (),
    tables: tuple[tuple[str, int], ...] = TABLES,
    optimizer: str = "rowwise_adagrad",
) -> Run:
    topology = ParallelTopology(world_size=world, sharding_group_size=group_size, ranks_per_node=group_size)
    topology.device_mesh("cpu")
    model = make_model(seed, tables)
    config = EmbeddingOptimizerConfig(name=optimizer, lr=LR)
    allowed = [sharding_type] + (["data_parallel"] if data_parallel else [])
    sharders = make_sharders(config.fused_params(), allowed)
    constraints = {
        n: TableConstraints(
            sharding_types=["data_parallel"] if n in data_parallel else [sharding_type],
            min_partition=4 if sharding_type == "column_wise" else None,  # dim 8 -> two column shards
        )
        for n, _ in tables
    }
    plan = make_sharding_plan(
        model, sharders, sharding_group_size=group_size, group_ranks_per_node=group_size, compute_device="cpu", constraints=constraints
    )
    sharded = shard_model(model, topology=topology, device=torch.device("cpu"), sharders=sharders, plan=plan)
    dp = config.make_torch_optimizer(sharded.data_parallel_table_params) if sharded.data_parallel_table_params else None
    dense = torch.optim.SGD([p for p in sharded.dmp.module.parameters() if not sharded.is_embedding_param(p)], lr=LR)
    sync = None
    if not topology.is_1d:
        modules = [sharded.dmp.module.get_submodule(fqn) for fqn in sharded.embedding_module_fqns]
        sync = ReplicaSynchronizer.for_sharded_modules(
            modules, sharded.fused_optimizer, topology.replica_process_group(), config=ReplicaSyncConfig()
        )
        sync.broadcast_from_first_replica()  # as the strategy does
    return Run(rank, world, topology, sharded, config, dp, dense, sync)


def snapshot(run: Run) -> dict[str, Pieces | dict[str, float]]:
    """This rank's table pieces and Adagrad state, read the way TorchRec exposes them.

    Row-wise state pieces are spread over their shard's columns ("by column"), so a table's pieces
    assemble to one ``[rows, dim]`` tensor whatever the sharding type.
    """
    state_dict = run.sharded.dmp.module.state_dict()
    weights: Pieces = {}
    state: Pieces = {}
    steps: dict[str, float] = {}
    for key, value in state_dict.items():
        if not key.startswith("ebc."):
            continue
        if isinstance(value, ShardedTensor):
            weights[key] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
        else:
            weights[key] = [((0, 0), value.detach().clone())]
    for key, states in run.sharded.fused_optimizer.state_dict()["state"].items():
        ((_, momentum),) = states.items()
        if len(momentum.size()) == 2:  # point-wise (Adagrad): sharded like the weight
            state[key] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in momentum.local_shards()]
            continue
        rows, dim = state_dict[key].size()
        metas = state_dict[key].metadata().shards_metadata
        full_width = all(m.shard_sizes[1] == dim for m in metas)
        by_column = sorted(metas, key=lambda m: m.shard_offsets[1])  # TorchRec stacks CW state in column order
        for shard in momentum.local_shards():
            offset = shard.metadata.shard_offsets[0]
            if full_width:
                at, cols = (offset, 0), dim
            else:
                meta = by_column[offset // rows]
                at, cols = (0, meta.shard_offsets[1]), meta.shard_sizes[1]
            state.setdefault(key, []).append((at, shard.tensor.detach().clone().reshape(-1, 1).expand(-1, cols).clone()))
    if run.dp_optimizer is not None:
        names = {id(p): n for n, p in run.sharded.dmp.module.named_parameters()}
        for param, param_state in run.dp_optimizer.state.items():
            key = names[id(param)]
            state[key] = [((0, 0), param_state["sum"].detach().expand(-1, DIM).clone())]
            steps[key] = float(param_state["step"])
    return {"weights": weights, "state": state, "steps": steps}


def assemble(snapshots: list[dict], part: str) -> dict[str, torch.Tensor]:
    rows = dict(TABLES)
    full: dict[str, torch.Tensor] = {}
    for snap in snapshots:
        for key, pieces in snap[part].items():
            out = full.setdefault(key, torch.full((rows[key.split(".")[-2]], DIM), float("nan")))
            for offsets, tensor in pieces:
                out[offsets[0] : offsets[0] + tensor.shape[0], offsets[1] : offsets[1] + tensor.shape[1]] = tensor
    for key, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"{part} of {key}: the ranks' pieces leave a gap"
    return full


def assert_equal_tables(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{what}: {key} differs\n{got[key]}\n{expected[key]}"


class RecordingWriter(FileSystemWriter):
    """Leaves a file naming the global rank that wrote, so the test can see who wrote tables."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        (Path(path) / f"written_by_rank_{dist.get_rank()}").touch()


class CrashingWriter(FileSystemWriter):
    """Writes this rank's data files, then the process dies before DCP finishes the save."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = super().write_data(plan, planner)
        future.wait()
        os._exit(3)


# ----------------------------------------------------------------- the chain, one launch per step
def _step_a_save_2d(rank: int, world: int, root: str) -> dict:
    init(rank, world)
    try:
        run = build(rank, world, group_size=2, sharding_type="row_wise", seed=0)
        for step in range(STEPS):
            run.train_step(step)
        path = save_checkpoint(
            Path(root) / "a",
            state=run.state(),
            topology=run.topology,
            host_state={"global_step": STEPS, "note": "host"},
            step=STEPS,
            extra_meta={"epoch": 0},
            storage_writer_factory=RecordingWriter,
        )
        result = {"orig": snapshot(run), "predictions": run.predict(), "path": str(path)}
        run.train_step(STEPS)
        result["after_extra_step"] = snapshot(run)
        return result
    finally:
        dist.destroy_process_group()


def _step_b_load_table_wise(rank: int, world: int, root: str) -> dict:
    init(rank, world)
    try:
        run = build(rank, world, group_size=world, sharding_type="table_wise", seed=1, data_parallel=("t2",))
        loaded = load_checkpoint(Path(root) / "a", state=run.state(), topology=run.topology)
        result: dict[str, Any] = {"loaded": snapshot(run), "host_state": loaded.host_state, "meta_step": loaded.meta.step}
        saver = AsyncCheckpointSaver(run.topology)
        handle = saver.save(Path(root) / "b", state=run.state(), step=STEPS)
        run.train_step(STEPS)  # changes the live tables while the save is in flight
        result["changed"] = snapshot(run)
        assert handle.wait() == Path(root) / "b"
        saver.close()

        # Point-wise state (Adagrad): row_wise -> column_wise.
        pointwise = build(rank, world, group_size=world, sharding_type="row_wise", seed=5, optimizer="adagrad")
        for step in range(STEPS):
            pointwise.train_step(step)
        save_checkpoint(Path(root) / "pointwise", state=pointwise.state(), topology=pointwise.topology, step=STEPS)
        result["pointwise_saved"] = snapshot(pointwise)
        columns = build(rank, world, group_size=world, sharding_type="column_wise", seed=6, optimizer="adagrad")
        load_checkpoint(Path(root) / "pointwise", state=columns.state(), topology=columns.topology)
        result["pointwise_loaded"] = snapshot(columns)
        result["pointwise_column_shards"] = max(
            len(v.metadata().shards_metadata) for v in columns.sharded.dmp.module.state_dict().values() if isinstance(v, ShardedTensor)
        )

        # A model whose tables were renamed (t0), resized (t1) and removed (t2): one clear error, no hang.
        other = build(rank, world, group_size=world, sharding_type="table_wise", seed=1, tables=(("t0_renamed", 3), ("t1", 24)))
        try:
            load_checkpoint(Path(root) / "a", state=other.state(), topology=other.topology)
            result["mismatch"] = None
        except CheckpointMismatchError as error:
            result["mismatch"] = str(error)
        partial = Path(root) / "partial_on_purpose"
        if rank == 0:
            partial.mkdir(exist_ok=True)
        dist.barrier()
        try:
            load_checkpoint(partial, state=run.state(), topology=run.topology)
            result["uncommitted"] = None
        except UncommittedCheckpointError as error:
            result["uncommitted"] = str(error)
        dist.barrier()  # the process group still works after both errors
        return result
    finally:
        dist.destroy_process_group()


def _step_c_load_column_wise(rank: int, world: int, root: str) -> dict:
    init(rank, world)
    try:
        run = build(rank, world, group_size=world, sharding_type="column_wise", seed=2)
        load_checkpoint(Path(root) / "b", state=run.state(), topology=run.topology)
        result: dict[str, Any] = {"loaded": snapshot(run)}
        result["column_shards"] = {k: len(v.metadata().shards_metadata) for k, v in run.sharded.dmp.module.state_dict().items() if isinstance(v, ShardedTensor)}
        save_checkpoint(Path(root) / "c", state=run.state(), topology=run.topology, step=STEPS)

        # Column shards that trained apart keep their own accumulators through a same-layout round trip.
        for step in range(STEPS, STEPS + 2):
            run.train_step(step)
        result["trained"] = snapshot(run)
        save_checkpoint(Path(root) / "c2", state=run.state(), topology=run.topology, step=STEPS + 2)
        with torch.no_grad():
            for states in run.sharded.fused_optimizer.state_dict()["state"].values():
                for momentum in states.values():
                    for shard in momentum.local_shards():
                        shard.tensor.zero_()
        load_checkpoint(Path(root) / "c2", state=run.state(), topology=run.topology)
        result["round_trip"] = snapshot(run)

        # ... and collapse to their column-weighted mean in a row-wise table.
        rows = build(rank, world, group_size=world, sharding_type="row_wise", seed=3)
        load_checkpoint(Path(root) / "c2", state=rows.state(), topology=rows.topology)
        result["collapsed"] = snapshot(rows)
        return result
    finally:
        dist.destroy_process_group()


def _step_d_load_2d(rank: int, world: int, root: str) -> dict:
    init(rank, world)
    try:
        run = build(rank, world, group_size=2, sharding_type="row_wise", seed=4)
        load_checkpoint(Path(root) / "c", state=run.state(), topology=run.topology)
        result = {"loaded": snapshot(run)}
        run.train_step(STEPS)  # the loaded optimizer state must be the one FBGEMM uses
        result["after_extra_step"] = snapshot(run)
        return result
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("chain"))
    results: dict[str, Any] = {"root": Path(root)}
    results["a"] = run_ranks(_step_a_save_2d, 4, root, timeout=120, ranks_per_node=2)
    results["b"] = run_ranks(_step_b_load_table_wise, 2, root, timeout=120)
    results["c"] = run_ranks(_step_c_load_column_wise, 3, root, timeout=120)
    results["d"] = run_ranks(_step_d_load_2d, 4, root, timeout=120, ranks_per_node=2)
    return results


def _full(snapshots: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return assemble(snapshots, "weights"), assemble(snapshots, "state")


def test_reshard_chain_keeps_tables_and_rowwise_adagrad_state_bit_exact(chain: dict[str, Any]) -> None:
    weights, state = _full([r["orig"] for r in chain["a"]])
    assert all(s.abs().sum() > 0 for s in state.values()), "training left the row-wise Adagrad state at zero"
    for step, key in (("b", "loaded"), ("c", "loaded"), ("d", "loaded")):
        got_weights, got_state = _full([r[key] for r in chain[step]])
        assert_equal_tables(got_weights, weights, f"tables after step {step}")
        assert_equal_tables(got_state, state, f"row-wise Adagrad state after step {step}")
    assert max(chain["c"][0]["column_shards"].values()) >= 2, "column_wise did not split any table into column shards"
    # The resumed 2D run takes the same next step as the original run did.
    assert_equal_tables(_full([r["after_extra_step"] for r in chain["d"]])[0], _full([r["after_extra_step"] for r in chain["a"]])[0], "next step")
    assert_equal_tables(_full([r["after_extra_step"] for r in chain["d"]])[1], _full([r["after_extra_step"] for r in chain["a"]])[1], "next step state")


def test_data_parallel_table_state_moves_both_ways(chain: dict[str, Any]) -> None:
    # Step b loaded t2 (row_wise in a) as data_parallel; step c loaded it back as column_wise.
    key = "ebc.embedding_bags.t2.weight"
    b0 = chain["b"][0]["loaded"]
    assert b0["weights"][key][0][0] == (0, 0) and key in b0["steps"]
    assert b0["steps"][key] == STEPS, "a data_parallel table loaded from fused state takes the checkpoint's step"
    assert chain["b"][0]["host_state"] == {"global_step": STEPS, "note": "host"}
    assert chain["b"][0]["meta_step"] == STEPS


def test_async_save_commits_the_state_of_when_it_started(chain: dict[str, Any]) -> None:
    weights, _ = _full([r["orig"] for r in chain["a"]])
    changed, _ = _full([r["changed"] for r in chain["b"]])
    assert not all(torch.equal(changed[k], weights[k]) for k in weights), "training after the async save changed nothing"
    assert is_committed(chain["root"] / "b") and not temporary_path(chain["root"] / "b").exists()
    # What step c loaded from b equals a, checked in the chain test; here: b's meta is complete.
    meta = read_meta(chain["root"] / "b")
    assert (meta.world_size, meta.sharding_group_size, meta.written_by_ranks) == (2, 2, [0, 1])


def test_pointwise_adagrad_state_reshards_like_the_weight(chain: dict[str, Any]) -> None:
    saved_weights, saved_state = _full([r["pointwise_saved"] for r in chain["b"]])
    loaded_weights, loaded_state = _full([r["pointwise_loaded"] for r in chain["b"]])
    assert all(s.abs().sum() > 0 for s in saved_state.values())
    assert chain["b"][0]["pointwise_column_shards"] >= 2, "column_wise did not split any table"
    assert_equal_tables(loaded_weights, saved_weights, "Adagrad RW -> CW tables")
    assert_equal_tables(loaded_state, saved_state, "Adagrad RW -> CW state")


def test_column_shards_keep_their_accumulators_and_collapse_to_the_weighted_mean(chain: dict[str, Any]) -> None:
    trained_weights, trained_state = _full([r["trained"] for r in chain["c"]])
    got_weights, got_state = _full([r["round_trip"] for r in chain["c"]])
    assert_equal_tables(got_weights, trained_weights, "CW round trip tables")
    assert_equal_tables(got_state, trained_state, "CW round trip state")
    assert any(not torch.equal(s, s[:, :1].expand_as(s)) for s in trained_state.values()), "column shards did not drift apart"
    collapsed_weights, collapsed_state = _full([r["collapsed"] for r in chain["c"]])
    assert_equal_tables(collapsed_weights, trained_weights, "CW -> RW tables")
    for key, by_column in trained_state.items():
        mean = by_column.double().mean(dim=1).float()
        assert torch.equal(collapsed_state[key][:, 0], mean), key


def test_2d_save_writes_one_replica_and_a_readable_meta_json(chain: dict[str, Any]) -> None:
    path = chain["root"] / "a"
    assert sorted(p.name for p in path.glob("written_by_rank_*")) == ["written_by_rank_0", "written_by_rank_1"]
    meta = read_meta(path)
    assert (meta.step, meta.world_size, meta.sharding_group_size, meta.num_replicas) == (STEPS, 4, 2, 2)
    assert meta.written_by_ranks == [0, 1] and meta.extra == {"epoch": 0}
    assert {row["sharding_type"] for row in meta.plan} == {"row_wise"} and len(meta.plan) == len(TABLES)
    assert meta.tables["ebc.embedding_bags.t0.weight"] == {"table": "t0", "shape": [3, DIM], "sharding_type": "row_wise"}
    assert meta.embedding_optimizer == {"name": "rowwise_adagrad", "states": ["rowwise_momentum1"]}
    assert meta.versions["torch"] == torch.__version__ and all(meta.versions.values())
    assert latest_checkpoint(chain["root"]) == chain["root"] / "c2"  # the highest step


def test_incompatible_checkpoint_names_tables_and_shapes_without_hanging(chain: dict[str, Any]) -> None:
    messages = [r["mismatch"] for r in chain["b"]]
    assert all(m == messages[0] for m in messages) and messages[0] is not None
    message = messages[0]
    assert "table 't1' ('model.ebc.embedding_bags.t1.weight'): the checkpoint has shape (20, 8), the model expects (24, 8)" in message
    assert "table 't0_renamed' ('model.ebc.embedding_bags.t0_renamed.weight') (expected shape (3, 8)) is not in the checkpoint" in message
    assert "'model.ebc.embedding_bags.t0.weight' with that shape instead: was it renamed?" in message
    assert "'model.ebc.embedding_bags.t2.weight' (shape (7, 8)) is in the checkpoint but not in the model" in message
    assert "How to fix" in message
    assert all("no COMMITTED marker" in r["uncommitted"] for r in chain["b"])


def test_export_to_an_unsharded_model_matches_the_sharded_predictions(chain: dict[str, Any]) -> None:
    model = make_model(seed=123)
    loaded = load_unsharded(chain["root"] / "a", model)
    assert loaded.host_state == {"global_step": STEPS, "note": "host"}
    weights, _ = _full([r["orig"] for r in chain["a"]])
    for key, expected in weights.items():
        assert torch.equal(model.state_dict()[key], expected), key
    with torch.no_grad():
        predictions = model(batch(EVAL_STEP)[0])
    torch.testing.assert_close(predictions, torch.cat([r["predictions"] for r in chain["a"]]))


def test_safetensors_export_of_the_2d_checkpoint_predicts_as_the_sharded_model(chain: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lightning_recsys.checkpoint.safetensors_export import export_safetensors

    model = make_model(seed=321)
    model.load_state_dict(load_file(export_safetensors(chain["root"] / "a", tmp_path / "a.safetensors")))
    with torch.no_grad():
        predictions = model(batch(EVAL_STEP)[0])
    torch.testing.assert_close(predictions, torch.cat([r["predictions"] for r in chain["a"]]))
    unsharded = make_model(seed=123)
    load_unsharded(chain["root"] / "a", unsharded)
    with torch.no_grad():
        assert torch.equal(predictions, unsharded(batch(EVAL_STEP)[0]))  # the same weights, bit for bit


# ----------------------------------------------------------------- crash during save
def _save_then_crash(rank: int, world: int, root: str) -> None:
    init(rank, world)
    run = build(rank, world, group_size=world, sharding_type="table_wise", seed=0, optimizer="sgd")
    save_checkpoint(Path(root) / "good", state=run.state(), topology=run.topology, step=1)
    with torch.no_grad():
        for value in run.sharded.dmp.module.state_dict().values():
            for shard in value.local_shards() if isinstance(value, ShardedTensor) else []:
                shard.tensor.add_(1.0)
    save_checkpoint(Path(root) / "newer", state=run.state(), topology=run.topology, step=2, storage_writer_factory=CrashingWriter)
    raise AssertionError("unreachable: every rank dies inside the second save")


def test_crash_during_save_leaves_the_previous_checkpoint_as_the_latest(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="died without a result"):
        run_ranks(_save_then_crash, 2, str(tmp_path), timeout=120)
    partial = temporary_path(tmp_path / "newer")
    assert any(partial.glob("*.distcp")), "the crash happened before any data file was written"
    assert not is_committed(partial) and not (tmp_path / "newer").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "good"
    with pytest.raises(UncommittedCheckpointError, match="no COMMITTED marker"):
        load_unsharded(partial, make_model(seed=0))
    model = make_model(seed=5)
    load_unsharded(tmp_path / "good", model)
    expected = make_model(seed=0).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
