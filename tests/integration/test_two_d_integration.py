"""2D parallelism with 4 processes emulating 2 nodes of 2 ranks (gloo): equivalence, replica sync, traffic."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from lightning_recsys.testing.oracle import Shards, assemble
from lightning_recsys.testing.oracle.click import CONFIG, STEPS, assert_matches, fit_sharded, make_model, sgd_strategy, shards_of, train_unsharded
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import EmbeddingOptimizerConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.planner.config import PlanningConfig

WORLD_SIZE, NODES, PER_NODE = 4, 2, 2


def _traffic(strategy) -> list[dict]:
    return [
        {"purpose": k.purpose, "op": k.op, "group": k.group, "spans_nodes": k.spans_nodes,
         "payload": t.payload_bytes, "inter_node": t.inter_node_bytes}
        for k, t in strategy.comm_accounting.last_step.items()
    ]


def _fit_1d_and_both_2d_layouts(rank: int, world_size: int, sharding_type: str) -> dict:
    results = {}
    for name, kwargs in {
        "1d": {"sharding_group_size": WORLD_SIZE},
        "all_to_all_optimized": {"sharding_group_size": PER_NODE},
        "all_reduce_optimized": {"sharding_group_size": PER_NODE, "layout": "all_reduce_optimized"},
    }.items():
        allowed = None if sharding_type == "default" else [sharding_type]  # default: the planner picks, data_parallel too
        strategy = sgd_strategy(sharding_types=allowed, **kwargs)
        model, trainer, predictions = fit_sharded(rank, world_size, strategy, devices=PER_NODE, num_nodes=NODES)
        assert trainer.global_step == STEPS
        results[name] = {
            "shards": shards_of(model),
            "predictions": predictions,
            "traffic": _traffic(strategy),
            "mesh": model.device_mesh.mesh.tolist(),
            "shard_group": sorted(torch.distributed.get_process_group_ranks(model.device_mesh.get_group("shard"))),
        }
    return results


def _assert_replicas_identical(shards_by_rank: list[Shards], replica_groups: list[list[int]]) -> None:
    for group in replica_groups:
        first = shards_by_rank[group[0]]
        for other in group[1:]:
            assert first.keys() == shards_by_rank[other].keys()
            for key, pieces in first.items():
                for (offsets, tensor), (other_offsets, other_tensor) in zip(pieces, shards_by_rank[other][key]):
                    assert offsets == other_offsets
                    assert torch.equal(tensor, other_tensor), f"{key} differs between replica ranks {group[0]} and {other}"


@pytest.fixture(scope="module")
def oracle():
    return train_unsharded()


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise", "default"])
def test_2d_matches_1d_and_unsharded_and_keeps_embedding_traffic_inside_a_node(sharding_type, oracle):
    expected_state, expected_predictions = oracle
    results = run_ranks(_fit_1d_and_both_2d_layouts, WORLD_SIZE, sharding_type, timeout=300, ranks_per_node=PER_NODE)

    one_d_shards = [r["1d"]["shards"] for r in results]
    if sharding_type == "column_wise":  # the tables really are cut into column shards
        assert any(len(offsets) == 2 and offsets[1] > 0 for shards in one_d_shards for pieces in shards.values() for offsets, _ in pieces)
    for name, replica_groups in {
        "1d": [[0], [1], [2], [3]],
        "all_to_all_optimized": [[0, 2], [1, 3]],
        "all_reduce_optimized": [[0, 1], [2, 3]],
    }.items():
        shards = [r[name]["shards"] for r in results]
        predictions = [r[name]["predictions"] for r in results]
        _assert_replicas_identical(shards, replica_groups)
        # Each sharding group holds a whole replica: assemble it from rank 0's group alone.
        group = results[0][name]["shard_group"]
        assert_matches([shards[r] for r in group], predictions, expected_state, expected_predictions)
        for key, like in expected_state.items():
            torch.testing.assert_close(assemble([shards[r] for r in group], key, like), assemble(one_d_shards, key, like))
        torch.testing.assert_close(torch.cat(predictions), torch.cat([r["1d"]["predictions"] for r in results]))
    assert results[0]["all_to_all_optimized"]["mesh"] == [[0, 1], [2, 3]]
    assert results[0]["all_reduce_optimized"]["mesh"] == [[0, 2], [1, 3]]

    if sharding_type == "default":
        return  # the planner makes these tiny tables data_parallel: no embedding all-to-all to check
    for rank, result in enumerate(results):
        _assert_traffic(result["all_to_all_optimized"]["traffic"], crossing={"replica_sync", "dense_grads", "batch_handshake"}, rank=rank)
        _assert_traffic(result["all_reduce_optimized"]["traffic"], crossing={"embeddings", "sparse_ids", "dense_grads", "batch_handshake"}, rank=rank)


def _assert_traffic(rows: list[dict], *, crossing: set[str], rank: int) -> None:
    """From the recorded bytes of the last training step: exactly the ``crossing`` purposes cross nodes."""
    by_purpose: dict[str, list[dict]] = {}
    for row in rows:
        by_purpose.setdefault(row["purpose"], []).append(row)
    # The batch handshake (an all_gather over the world, issued while the batch is fetched) has its own row.
    assert {"embeddings", "sparse_ids", "replica_sync", "dense_grads", "batch_handshake"} <= set(by_purpose), f"rank {rank}: {rows}"
    assert "all_to_all" in {r["op"] for r in by_purpose["sparse_ids"]}, f"rank {rank}: {rows}"
    for purpose, purpose_rows in by_purpose.items():
        assert sum(r["payload"] for r in purpose_rows) > 0, f"rank {rank}: no {purpose} bytes: {rows}"
        inter = sum(r["inter_node"] for r in purpose_rows)
        if purpose in crossing:
            assert inter > 0, f"rank {rank}: {purpose} should cross nodes: {purpose_rows}"
        else:
            assert inter == 0, f"rank {rank}: {purpose} crossed nodes: {purpose_rows}"


class _ShardsAfterEachStep(Callback):
    def __init__(self) -> None:
        self.at_start: Shards = {}
        self.per_step: list[Shards] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_start = shards_of(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_step.append(shards_of(pl_module))


def _optimizer_state_shards(strategy) -> Shards:
    state: Shards = {}
    for param_state in strategy.sharded_model.fused_optimizer.state.values():
        for name, value in param_state.items():
            if hasattr(value, "local_shards"):
                state[name] = [(tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
    return state


def _fit_with_sync_settings(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # each rank initializes its (meta) tables differently; replicas must still start equal
    every_2 = _ShardsAfterEachStep()
    strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=ReplicaSyncConfig(every_n_steps=2))
    model, _, _ = fit_sharded(
        rank, world_size, strategy, devices=PER_NODE, num_nodes=NODES, callbacks=[every_2], model=make_model("meta", seed=None)
    )
    result = {"at_start": every_2.at_start, "per_step": every_2.per_step, "after_fit": shards_of(model)}
    for sync_state in (True, False):
        strategy = TwoDRecStrategy(
            embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1),
            planning=PlanningConfig(sharding_types=["row_wise"]),
            sharding_group_size=PER_NODE,
            replica_sync=ReplicaSyncConfig(optimizer_state=sync_state),
            process_group_timeout=60,
        )
        model, _, _ = fit_sharded(rank, world_size, strategy, devices=PER_NODE, num_nodes=NODES)
        result[f"adagrad_sync_state={sync_state}"] = {"weights": shards_of(model), "state": _optimizer_state_shards(strategy)}
    return result


def _replicas_identical(shards_by_rank: list[Shards]) -> bool:
    try:
        _assert_replicas_identical(shards_by_rank, [[0, 2], [1, 3]])
    except AssertionError:
        return False
    return True


def test_sync_every_n_steps_and_optimizer_state_sync():
    results = run_ranks(_fit_with_sync_settings, WORLD_SIZE, timeout=300, ranks_per_node=PER_NODE)

    # every_n_steps=2 over 3 steps: apart after step 1, equal after the step-2 sync, apart after
    # step 3, equal again after the sync at the end of training.
    assert _replicas_identical([r["at_start"] for r in results])
    identical_after_step = [_replicas_identical([r["per_step"][step] for r in results]) for step in range(STEPS)]
    assert identical_after_step == [False, True, False]
    assert _replicas_identical([r["after_fit"] for r in results])

    synced, unsynced = results[0]["adagrad_sync_state=True"], results[0]["adagrad_sync_state=False"]
    assert synced["state"], "the row-wise Adagrad run has no fused optimizer state to compare"
    assert _replicas_identical([r["adagrad_sync_state=True"]["weights"] for r in results])
    assert _replicas_identical([r["adagrad_sync_state=True"]["state"] for r in results])
    assert _replicas_identical([r["adagrad_sync_state=False"]["weights"] for r in results])
    assert not _replicas_identical([r["adagrad_sync_state=False"]["state"] for r in results])
    assert synced["state"].keys() == unsynced["state"].keys()


def _fit_with_validation_mid_training(rank: int, world_size: int) -> dict:
    from lightning.pytorch import Trainer

    from lightning_recsys.data import SyntheticClickLogDataModule

    strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE)  # touched rows, every step
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=STEPS, val_check_interval=1,
        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = make_model()
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    return shards_of(model)


def test_replicas_stay_identical_when_validation_runs_between_training_steps():
    # Lightning restores the training mode after validation by setting `.training` on named_modules(),
    # which never reaches TorchRec's lookups (a plain list): the fused kernels stayed in eval mode and
    # their touched rows were no longer tracked, so the replicas silently drifted apart.
    results = run_ranks(_fit_with_validation_mid_training, WORLD_SIZE, timeout=300, ranks_per_node=PER_NODE)
    _assert_replicas_identical(results, [[0, 2], [1, 3]])


class _ShardsAtHooks(Callback):
    """The shards as a callback sees them when training ends and when validation starts."""

    def __init__(self) -> None:
        self.at: dict[str, Shards] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self.at["on_train_end"] = shards_of(pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.at["on_validation_start"] = shards_of(pl_module)


def _fit_and_see_hooks(rank: int, world_size: int, sync: ReplicaSyncConfig) -> dict[str, Shards]:
    from lightning.pytorch import Trainer

    from lightning_recsys.data import SyntheticClickLogDataModule

    seen = _ShardsAtHooks()
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=NODES, max_steps=STEPS, val_check_interval=2, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=sync), callbacks=[seen],
    )
    trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    return seen.at


@pytest.mark.parametrize("sync", [ReplicaSyncConfig(overlap=True), ReplicaSyncConfig(every_n_steps=3)], ids=["overlap", "every_3"])
def test_callbacks_see_one_synchronized_model_when_training_ends_and_validation_starts(sync):
    # Before: Lightning calls the callbacks' (and the module's) on_train_end and on_validation_start
    # before the strategy's, which is where the replicas were synced; a callback exporting or checking
    # the tables at the end of training saw replicas that differed (an overlapped sync still in flight,
    # or the steps of a partial interval). Here validation runs after step 2 and training ends after step 3,
    # both with a sync in flight (overlap) or steps since the last sync (every 3).
    assert STEPS == 3
    results = run_ranks(_fit_and_see_hooks, WORLD_SIZE, sync, timeout=300, ranks_per_node=PER_NODE)
    for hook in ("on_train_end", "on_validation_start"):
        _assert_replicas_identical([r[hook] for r in results], [[0, 2], [1, 3]])
