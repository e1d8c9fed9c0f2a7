"""Crafted and damaged checkpoints under 2 ranks (gloo): refused on every rank, never run, nothing half-loaded.

fit/validate/test/predict(ckpt_path=...) under TwoDRecStrategy refuse a crafted pickle in
host_state.pt, in DCP's index (.metadata) and in a byte item of a .distcp file; Trainer-free
``load_checkpoint`` names each kind of damage (a representative part of the catalogue in
``crafted_checkpoints.DAMAGES``) on every rank, with every rank's model as it was.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.crafted_checkpoints import (
    CONFIG,
    DAMAGES,
    HOSTILE,
    edit_index,
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
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.processes import free_port, run_ranks
from torch.distributed._shard.sharded_tensor import ShardedTensor

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.checkpoint import load_checkpoint, save_checkpoint
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.strategies import DCPCheckpointIO

ENTRY_POINTS = ("fit", "validate", "test", "predict")


def _trainer(world_size: int, *, trusted: bool = False) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=world_size,
        strategy=TwoDRecStrategy(process_group_timeout=300, checkpoint_io=DCPCheckpointIO(trusted=trusted)),
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
            getattr(trainer, entry.removesuffix("_trusted"))(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=path)
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


# ----------------------------------------------------------------- hostile kinds on 2 ranks, one world for all
# One process group runs a representative part of the hostile catalogue (crafted_checkpoints.HOSTILE)
# through fit(ckpt_path=...) and validate(ckpt_path=...), the collective load_checkpoint with every
# rank's model compared before and after, and a resume whose crafted ModelCheckpoint state names a
# directory outside the checkpoint folder as the previous best.
TRAINER_KINDS = (
    "index nested a million deep", "index BUILD sets a class attribute", "index memo reuse of a large list",
    "index chunks leave a gap", "shard a symlink", "record compressed", "host state reshape record grows a table", "meta.json a FIFO",
)


def _first_tensor(metadata: Any) -> tuple[str, Any]:
    return next((k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) == 2 and v.size[0] > 1)


def _gap_in_first_tensor(metadata: Any) -> None:
    _, item = _first_tensor(metadata)
    chunk = item.chunks[0]
    chunk.sizes = type(chunk.sizes)([chunk.sizes[0] - 1, *chunk.sizes[1:]])


def _collective_kinds(data_root: Path) -> dict[str, tuple[Any, str]]:
    """Kinds for the Trainer-free sharded model (other keys than the ranker's): how to apply each, its message."""
    hostile = {k.name: k for k in HOSTILE}
    return {
        "index nested a million deep": (hostile["index nested a million deep"].apply, hostile["index nested a million deep"].pattern),
        "index BUILD sets a class attribute": (hostile["index BUILD sets a class attribute"].apply, r"BUILD on the class"),
        "index a FIFO": (hostile["index a FIFO"].apply, r"\.metadata: .*FIFO"),
        "index chunks leave a gap": (lambda d: edit_index(d, _gap_in_first_tensor), r"\.metadata: .*cover \d+ of its \d+ elements"),
        "meta.json a FIFO": (hostile["meta.json a FIFO"].apply, r"meta\.json cannot be read"),
        "host state compressed": (hostile["host state compressed"].apply, r"host_state\.pt: .*compressed"),
    }


def _resume_with_a_foreign_best(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """fit with ModelCheckpoint(save_top_k=1), craft its state's best_model_path to ../../precious, resume and save again."""
    import torch as _torch

    folder, victim = root / "resume" / "checkpoints", root / "precious"
    if rank == 0:
        victim.mkdir(parents=True, exist_ok=True)
        (victim / "thesis.tex").write_text("years of work")

    def trainer(max_epochs: int) -> Trainer:
        return Trainer(
            accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=300),
            logger=False, enable_progress_bar=False, enable_model_summary=False, max_epochs=max_epochs,
            limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0,
            callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=1, filename="{epoch}")],
        )

    first = trainer(1)
    first.fit(ranker(seed=0), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    saved = folder / "epoch=0.ckpt"
    flag = root / "resume" / "edited"
    if rank == 0:
        data = saved.resolve()
        state = _torch.load(data / "host_state.pt", weights_only=True)
        for callback_state in state["callbacks"].values():
            if "best_model_path" in callback_state:
                callback_state["best_model_path"] = str(folder / ".." / ".." / "precious")
                callback_state.pop("dirpath", None)
        _torch.save(state, data / "host_state.pt")
        flag.write_text("done")
    for _ in range(600):  # the fit's process group is gone: wait for rank 0's edit by a file
        if flag.exists():
            break
        time.sleep(0.1)
    second = trainer(2)
    second.fit(ranker(seed=0), datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=str(saved))
    return {"victim": (victim / "thesis.tex").exists(), "saved": sorted(os.listdir(folder))}


def _hostile_world(rank: int, world_size: int, root_text: str) -> dict[str, Any]:
    from test_checkpoint_integration import build, init  # the Trainer-free sharded setup of the checkpoint tests

    root = Path(root_text)
    out: dict[str, Any] = {"trainer": {}, "collective": {}}
    # The collective load first, in a process group of its own; the Trainers below start theirs.
    init(rank, world_size)
    run = build(rank, world_size, group_size=world_size, sharding_type="table_wise", seed=0)
    kinds = _collective_kinds(root)
    paths = {name: root / "collective" / name.replace(" ", "_") for name in kinds}
    for path in paths.values():
        save_checkpoint(path, state=run.state(), topology=run.topology, host_state={"global_step": 3}, step=3)
    if rank == 0:
        for name, path in paths.items():
            kinds[name][0](path.resolve())
    dist.barrier()
    target = build(rank, world_size, group_size=world_size, sharding_type="table_wise", seed=1)
    for name, path in paths.items():
        before = _local_weights(target.sharded.dmp.module.state_dict())
        try:
            load_checkpoint(path, state=target.state(), topology=target.topology)
            outcome = ("loaded", "")
        except Exception as error:  # noqa: BLE001 - the refusal is the result
            outcome = (type(error).__name__, str(error)[:2000])
        after = _local_weights(target.sharded.dmp.module.state_dict())
        out["collective"][name] = (*outcome, before.keys() == after.keys() and all(_torch_equal(before[k], after[k]) for k in before))
    # The Trainers below start a process group of their own, on a fresh port. On the same port, rank 0's
    # TCPStore is the one this group used (torch's env:// store is multi-tenant, one per port and process)
    # and destroy_process_group resets the group names, so the new groups' gloo rendezvous could read this
    # group's keys while its pairs are still alive (run and target hold them): one of five runs hung in
    # the first Trainer's first broadcast (both ranks in it, by faulthandler stacks); ten runs on a fresh port did not.
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, 0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    for name in TRAINER_KINDS:
        path = root / "trainer" / name.replace(" ", "_") / "last.ckpt"
        for entry in ("fit", "validate"):
            trainer = _trainer(world_size)
            try:
                getattr(trainer, entry)(ranker(seed=1), datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=str(path))
                out["trainer"][(name, entry)] = ("loaded", "")
            except Exception as error:  # noqa: BLE001 - the refusal is the result
                out["trainer"][(name, entry)] = (type(error).__name__, str(error)[:2000])
    out["resume"] = _resume_with_a_foreign_best(rank, world_size, root)
    return out


def _torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b))


@pytest.fixture(scope="module")
def hostile_world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("hostile")
    hostile = {k.name: k for k in HOSTILE}
    for name in TRAINER_KINDS:  # the crafted ranker checkpoints, written in this process before the world starts
        source = ranker(seed=0)
        path = write_checkpoint(source, root / "trainer" / name.replace(" ", "_") / "last.ckpt", host_state(source))
        hostile[name].apply(path.resolve())
    return run_ranks(_hostile_world, 2, str(root), timeout=600), root


def test_hostile_kinds_are_refused_by_fit_and_validate_on_every_rank(hostile_world: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = hostile_world
    hostile = {k.name: k for k in HOSTILE}
    for rank, result in enumerate(results):
        for (name, entry), (kind, message) in result["trainer"].items():
            # The rank that found it raises it; a rank that did not names the rank that did (CheckpointError).
            assert kind in (hostile[name].error.__name__, "CheckpointError"), (rank, name, entry, kind, message[:500])
            assert re.search(hostile[name].pattern, message, re.S), (rank, name, entry, message[:500])
    assert len(results[0]["trainer"]) == 2 * len(TRAINER_KINDS)


def test_hostile_kinds_are_refused_by_the_collective_load_with_every_model_untouched(hostile_world: tuple[list[dict[str, Any]], Path]) -> None:
    results, root = hostile_world
    kinds = _collective_kinds(root)
    for rank, result in enumerate(results):
        assert result["collective"].keys() == kinds.keys()
        for name, (kind, message, untouched) in result["collective"].items():
            assert kind in ("CheckpointCorruptError", "CheckpointError"), (rank, name, kind, message[:500])
            assert re.search(kinds[name][1], message, re.S), (rank, name, message[:500])
            assert untouched, (rank, name, "the model changed")


def test_a_resume_whose_crafted_state_names_a_directory_outside_as_best_deletes_nothing(hostile_world: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = hostile_world
    for rank, result in enumerate(results):
        assert result["resume"]["victim"], (rank, "the directory outside the checkpoint folder was deleted")
    assert "epoch=1.ckpt" in results[0]["resume"]["saved"], results[0]["resume"]  # the resumed fit did save again
