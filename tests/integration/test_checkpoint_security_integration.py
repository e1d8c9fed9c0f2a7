"""Crafted and damaged checkpoints under 2 ranks (gloo): refused on every rank, never run, nothing half-loaded.

fit/validate/test/predict(ckpt_path=...) under TwoDRecStrategy refuse a crafted pickle in
host_state.pt, in DCP's index (.metadata) and in a byte item of a .distcp file; Trainer-free
``load_checkpoint`` names each kind of damage (a representative part of the catalogue in
``crafted_checkpoints.DAMAGES``) on every rank, with every rank's model as it was.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from crafted_checkpoints import (
    CONFIG,
    DAMAGES,
    SideEffect,
    corrupt_error_pattern,
    craft_byte_item,
    craft_index,
    extra_state_ranker,
    host_state,
    ranker,
    write_checkpoint,
)
from lightning.pytorch import Trainer
from lightning_recsys.testing.processes import run_ranks
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.checkpoint import load_checkpoint, save_checkpoint
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.strategies import DCPCheckpointIO

ENTRY_POINTS = ("fit", "validate", "test", "predict")


def _trainer(world_size: int, *, trusted: bool = False) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=world_size,
        strategy=TwoDRecStrategy(process_group_timeout=60, checkpoint_io=DCPCheckpointIO(trusted=trusted)),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        max_epochs=1, limit_train_batches=1, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1,
    )


def _entry_points(rank: int, world_size: int, path: str, extra_state: bool, trusted_too: bool) -> dict[str, str]:
    """Each Trainer entry point with ckpt_path=path on this rank: its error, or "loaded"."""
    results: dict[str, str] = {}
    for entry in ENTRY_POINTS + (("validate_trusted",) if trusted_too else ()):
        model = extra_state_ranker(seed=1) if extra_state else ranker(seed=1)
        trainer = _trainer(world_size, trusted=entry.endswith("_trusted"))
        try:
            getattr(trainer, entry.removesuffix("_trusted"))(model, datamodule=SyntheticClickLogDataModule(CONFIG), ckpt_path=path)
            results[entry] = "loaded"
        except Exception as error:  # noqa: BLE001 - the refusal is the result
            results[entry] = f"{type(error).__name__}: {error}"
    return results


def _refused_everywhere(results: list[dict[str, str]], pattern: str) -> None:
    for rank, by_entry in enumerate(results):
        for entry in ENTRY_POINTS:
            assert re.search(pattern, by_entry[entry], re.S), (rank, entry, by_entry[entry][:600])


def test_validate_refuses_a_crafted_host_state_on_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", host_state(source, x=SideEffect(marker)))
    results = run_ranks(_entry_points, 2, str(path), False, False, timeout=240)
    _refused_everywhere(results, "Weights only load failed")
    assert not marker.exists(), "ckpt_path ran the pickled payload of host_state.pt"


def test_every_entry_point_refuses_a_crafted_index_on_every_rank_and_trusted_loads_it(tmp_path: Path) -> None:
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", host_state(source))
    craft_index(path.resolve(), marker)
    results = run_ranks(_entry_points, 2, str(path), False, True, timeout=400)
    # Every rank reads the index itself, so each raises the refusal itself.
    _refused_everywhere(results, r"^UnsafeCheckpointError: .*\.metadata: refused to unpickle the global os\.makedirs.*DCPCheckpointIO\(trusted=True\)")
    assert not any(by_entry[e] == "loaded" for by_entry in results for e in ENTRY_POINTS)
    # The explicit way out: DCPCheckpointIO(trusted=True) is DCP's own reading, which runs the payload.
    assert [r["validate_trusted"] for r in results] == ["loaded", "loaded"], results
    assert marker.exists()


def test_every_entry_point_refuses_a_crafted_byte_item_on_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "the_payload_ran"
    source = extra_state_ranker(seed=0)
    path = craft_byte_item(source, tmp_path / "last.ckpt", marker, host_state(source))
    results = run_ranks(_entry_points, 2, str(path), True, False, timeout=400)
    _refused_everywhere(results, r"^UnsafeCheckpointError: .*\.distcp: refused to load the item 'model\._extra_state\.vocab_version'.*os\.makedirs")
    assert not marker.exists(), "ckpt_path ran the pickled payload of a byte item"


# ----------------------------------------------------------------- damage on 2 ranks, Trainer-free
TWO_RANK_DAMAGES = (
    "index truncated", "index of another type", "index sizes disagree with the shard",
    "shard missing", "shard truncated", "shard overwritten at an item", "host state truncated",
)


def _local_weights(state_dict: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                out[f"{key}@{list(shard.metadata.shard_offsets)}"] = shard.tensor.detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
    return out


def _load_damaged(rank: int, world_size: int, root: str) -> dict[str, tuple[str, str, bool]]:
    from test_checkpoint_integration import build, init  # the Trainer-free sharded setup of the checkpoint tests

    init(rank, world_size)
    run = build(rank, world_size, group_size=world_size, sharding_type="table_wise", seed=0)
    damages = {d.name: d for d in DAMAGES}
    paths = {name: Path(root) / name.replace(" ", "_") for name in TWO_RANK_DAMAGES}
    for path in paths.values():
        save_checkpoint(path, state=run.state(), topology=run.topology, host_state={"global_step": 3}, step=3)
    if rank == 0:
        for name, path in paths.items():
            damages[name].apply(path.resolve())
    dist.barrier()
    target = build(rank, world_size, group_size=world_size, sharding_type="table_wise", seed=1)
    results = {}
    for name, path in paths.items():
        before = _local_weights(target.sharded.dmp.module.state_dict())
        try:
            load_checkpoint(path, state=target.state(), topology=target.topology)
            outcome = ("loaded", "")
        except Exception as error:  # noqa: BLE001 - the refusal is the result
            outcome = (type(error).__name__, str(error))
        after = _local_weights(target.sharded.dmp.module.state_dict())
        untouched = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        results[name] = (*outcome, untouched)
    return results


def test_damage_is_named_on_every_rank_with_every_model_untouched(tmp_path: Path) -> None:
    results = run_ranks(_load_damaged, 2, str(tmp_path), timeout=240)
    damages = {d.name: d for d in DAMAGES}
    for rank, by_damage in enumerate(results):
        for name in TWO_RANK_DAMAGES:
            kind, message, untouched = by_damage[name]
            assert kind == "CheckpointCorruptError", (rank, name, kind, message[:500])
            assert re.search(corrupt_error_pattern(damages[name]), message, re.S), (rank, name, message[:500])
            assert untouched, (rank, name, "the model changed")
