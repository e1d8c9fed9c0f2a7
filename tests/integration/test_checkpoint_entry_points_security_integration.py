"""validate/test/predict(ckpt_path=...) refuse hostile checkpoints on 1 rank and on 2 ranks (issue 52).

One kind per failure class of ``crafted_checkpoints`` (a global in the index that would run code, a
BUILD on a class, chunks that leave a gap, a compressed record, a symlinked shard, a FIFO meta.json, a
reshape record that grows a table) goes through the Trainer entry points with ``ckpt_path`` in one
world per world size (the kinds are a loop inside it, not a world each). The model is sharded once by a
plain ``validate`` and reused by every later Trainer (``shard_or_reuse``), so each call is only the
refused load. On every rank and for every call: the documented error (the rank that found it raises it,
a rank that did not raises ``CheckpointError`` naming it), the model's local shards and dense tensors
bit-identical to what they were before (and equal to the unsharded model's weights), the module tree
and DCP's index classes unchanged, nothing under the test's folder (the checkpoints, the symlink's
target outside the checkpoint, a file beside them) written or deleted, and no payload run.

A call that blocks dumps every thread's stack to stderr (``faulthandler``) after ``HANG_DUMP_S``, and
``run_ranks`` fails after its timeout: a hang on hostile input is a failure with its stacks, not a skip.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_recsys.testing.crafted_checkpoints import CONFIG, HOSTILE, craft_index, host_state, ranker, write_checkpoint
from lightning.pytorch import Trainer
from lightning_recsys.testing.processes import run_ranks
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.parallel.sharding.sharded_model import local_shards

# One kind per failure class of the catalogue; "index with a global" is craft_index (UnsafeCheckpointError).
CRAFTED_GLOBAL = "index with a global that runs code"
KINDS = (
    CRAFTED_GLOBAL,
    "index BUILD sets a class attribute",
    "index chunks leave a gap",
    "record compressed",
    "shard a symlink",
    "meta.json a FIFO",
    "host state reshape record grows a table",
)
HANG_DUMP_S = 90  # a single Trainer call that takes longer dumps every thread's stack (a refusal takes a few seconds)

_CLASSES = [getattr(dcp_metadata, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties")] + [_StorageInfo, torch.Size]


def _expected(name: str) -> tuple[str, str]:
    """(error type name, message pattern) of a kind."""
    if name == CRAFTED_GLOBAL:
        return "UnsafeCheckpointError", r"\.metadata: refused to unpickle the global os\.makedirs"
    kind = next(k for k in HOSTILE if k.name == name)
    return kind.error.__name__, kind.pattern


def _write_kinds(root: Path) -> dict[str, str]:
    """Each kind's crafted checkpoint of the ranker (seed 0), under root/ckpts/<kind>/last.ckpt; and a file beside them."""
    hostile = {k.name: k for k in HOSTILE}
    paths = {}
    for name in KINDS:
        source = ranker(seed=0)
        path = write_checkpoint(source, root / "ckpts" / name.replace(" ", "_") / "last.ckpt", host_state(source))
        if name == CRAFTED_GLOBAL:
            craft_index(path.resolve(), root / "the_payload_ran")
        else:
            hostile[name].apply(path.resolve())
        paths[name] = str(path)
    (root / "outside").mkdir()
    (root / "outside" / "keep.txt").write_text("not a checkpoint")
    return paths


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` (not following links): mode, size and mtime."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _class_state() -> dict[str, dict[str, int]]:
    return {cls.__qualname__: {k: id(v) for k, v in vars(cls).items()} for cls in _CLASSES}


def _trainer(world_size: int, default_root_dir: Path) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60),
        default_root_dir=default_root_dir, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1,
    )


def _matches_unsharded(shards: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]], unsharded: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose local pieces differ from the unsharded model's tensor at their offsets."""
    wrong = []
    for key, pieces in shards.items():
        for offsets, piece in pieces:
            whole = unsharded[key]
            region = whole[tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))]
            if region.dtype != piece.dtype or not torch.equal(region, piece):
                wrong.append(key)
    return wrong


def _same(before: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]], after: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> bool:
    return before.keys() == after.keys() and all(
        [o for o, _ in before[k]] == [o for o, _ in after[k]]
        and all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(before[k], after[k]))
        for k in before
    )


def _refused_through_entry_points(rank: int, world_size: int, root_text: str, paths: dict[str, str], entries: tuple[str, ...]) -> dict[str, Any]:
    """Shard one ranker (seed 1) by a plain validate, then each entry point with each kind's ckpt_path; what each did."""
    root = Path(root_text)
    work = root / f"trainer_root_{rank}"  # the Trainers' default_root_dir, outside the folder compared below
    watched = root / "watched"
    faulthandler.dump_traceback_later(HANG_DUMP_S * 2, exit=False)  # the first validate shards (plans) the model
    model = ranker(seed=1)
    unsharded = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    _trainer(world_size, work).validate(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    before = local_shards(model)
    modules = [(n, id(m)) for n, m in model.named_modules()]
    out: dict[str, Any] = {"sharded_like_unsharded": _matches_unsharded(before, unsharded), "calls": {}}
    classes = _class_state()
    for name, path in paths.items():
        for entry in entries:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.dump_traceback_later(HANG_DUMP_S, exit=False)
            print(f"rank {rank}: {entry}(ckpt_path=<{name}>) starts", file=sys.stderr, flush=True)
            tree = _tree(watched)
            try:
                getattr(_trainer(world_size, work), entry)(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=path)
                outcome = ("loaded", "")
            except Exception as error:  # noqa: BLE001 - the refusal is the result
                outcome = (type(error).__name__, str(error)[:3000])
            out["calls"][(name, entry)] = {
                "error": outcome,
                "model_unchanged": _same(before, local_shards(model)),
                "modules_unchanged": [(n, id(m)) for n, m in model.named_modules()] == modules,
                "classes_unchanged": _class_state() == classes,
                "tree_unchanged": _tree(watched) == tree,
            }
    faulthandler.cancel_dump_traceback_later()
    return out


def _check(results: list[dict[str, Any]], entries: tuple[str, ...], root: Path, tree_before: dict) -> None:
    for rank, result in enumerate(results):
        assert result["sharded_like_unsharded"] == [], (rank, "the sharded model differs from the unsharded one", result["sharded_like_unsharded"])
        assert set(result["calls"]) == {(n, e) for n in KINDS for e in entries}, (rank, sorted(result["calls"]))
        for (name, entry), call in result["calls"].items():
            kind, message = call["error"]
            error, pattern = _expected(name)
            # On 2 ranks a rank that did not find the problem names the rank that did (CheckpointError).
            allowed = (error,) if len(results) == 1 else (error, "CheckpointError")
            assert kind in allowed, (rank, name, entry, kind, message[:800])
            assert re.search(pattern, message, re.S), (rank, name, entry, message[:800])
            assert call["model_unchanged"], (rank, name, entry, "the model changed")
            assert call["modules_unchanged"], (rank, name, entry, "the module tree changed")
            assert call["classes_unchanged"], (rank, name, entry, "a class attribute of DCP's index classes changed")
            assert call["tree_unchanged"], (rank, name, entry, "a file under the test's folder was written or deleted")
    for name in KINDS:
        for entry in entries:
            kinds = [r["calls"][(name, entry)]["error"][0] for r in results]
            assert _expected(name)[0] in kinds, (name, entry, "no rank raised the documented error itself", kinds)
    assert not (root / "watched" / "the_payload_ran").exists(), "a ckpt_path ran the index's payload"
    assert _tree(root / "watched") == tree_before, "a file under the test's folder was written or deleted"


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, dict[str, str], dict]:
    paths = _write_kinds(tmp_path / "watched")
    return tmp_path, paths, _tree(tmp_path / "watched")


def test_test_and_predict_with_ckpt_path_refuse_every_kind_on_two_ranks(crafted: tuple[Path, dict[str, str], dict]) -> None:
    root, paths, tree = crafted
    entries = ("test", "predict")
    results = run_ranks(_refused_through_entry_points, 2, str(root), paths, entries, timeout=400)
    _check(results, entries, root, tree)


def test_validate_test_and_predict_with_ckpt_path_refuse_every_kind_on_one_rank(crafted: tuple[Path, dict[str, str], dict]) -> None:
    root, paths, tree = crafted
    entries = ("validate", "test", "predict")
    results = run_ranks(_refused_through_entry_points, 1, str(root), paths, entries, timeout=400)
    _check(results, entries, root, tree)
