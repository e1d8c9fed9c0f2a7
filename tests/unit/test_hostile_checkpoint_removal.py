"""Removal only of our own checkpoints inside their folder, and no restored callback path outside it (issue 52, class 1)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_recsys.testing.crafted_checkpoints import host_state, ranker, write_checkpoint
from lightning_recsys.checkpoint.host_state_checks import drop_foreign_checkpoint_paths
from lightning_recsys.checkpoint.removal import CheckpointRemovalSkipped, remove_checkpoint
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(checkpoint folder, a committed checkpoint in it, a victim directory outside it holding a file)."""
    folder = tmp_path / "run" / "checkpoints"
    model = ranker(seed=0)
    path = write_checkpoint(model, folder / "epoch=0.ckpt", host_state(model))
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    return folder, path, victim


def _skipped(path: object, **kw: object) -> str:
    with pytest.warns(CheckpointRemovalSkipped) as caught:
        assert remove_checkpoint(path, **kw) is False  # type: ignore[arg-type]
    assert len(caught) == 1
    return str(caught[0].message)


def test_a_path_climbing_out_with_dotdot_is_skipped_with_one_warning(layout: tuple[Path, Path, Path]) -> None:
    folder, _, victim = layout
    message = _skipped(str(folder / ".." / ".." / "precious"), folders=[folder])
    assert "precious" in message and "'..'" in message
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_a_directory_outside_the_folder_is_skipped_even_if_it_looks_committed(layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    folder, path, victim = layout
    (victim / "COMMITTED").write_text("{}")
    (victim / "meta.json").write_text('{"format": "lightning_recsys.dcp"}')
    assert "not inside the checkpoint folder" in _skipped(victim, folders=[folder])
    assert (victim / "thesis.tex").exists()


def test_a_directory_in_the_folder_without_our_marker_and_layout_is_skipped(layout: tuple[Path, Path, Path]) -> None:
    folder, _, _ = layout
    stranger = folder / "notes"
    stranger.mkdir()
    (stranger / "a.txt").write_text("x")
    assert "not a committed checkpoint of this package" in _skipped(stranger, folders=[folder])
    fake = folder / "fake.ckpt"
    fake.mkdir()
    (fake / "COMMITTED").write_text("{}")
    (fake / "meta.json").write_text('{"format": "someone else"}')
    assert "not this package's format" in _skipped(fake, folders=[folder])
    assert (stranger / "a.txt").exists() and (fake / "COMMITTED").exists()


def test_a_name_that_is_a_symlink_out_of_the_folder_is_never_followed(layout: tuple[Path, Path, Path]) -> None:
    folder, _, victim = layout
    link = folder / "best.ckpt"
    os.symlink(victim, link)
    assert "not to a checkpoint of this folder" in _skipped(link, folders=[folder])
    assert (victim / "thesis.tex").exists() and link.is_symlink()


def test_a_file_is_skipped(layout: tuple[Path, Path, Path]) -> None:
    folder, _, _ = layout
    (folder / "model.pt").write_bytes(b"x")
    assert "is a file" in _skipped(folder / "model.pt", folders=[folder])


def test_our_committed_checkpoint_in_its_folder_is_removed_with_its_data(layout: tuple[Path, Path, Path]) -> None:
    folder, path, _ = layout
    data = path.resolve()
    assert remove_checkpoint(path, folders=[folder]) is True
    assert not os.path.lexists(path) and not data.exists() and os.listdir(folder) == []


def test_the_checkpoint_io_removes_only_inside_the_trainers_checkpoint_folders(layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    folder, path, victim = layout
    io = DCPCheckpointIO()
    io.connect(SimpleNamespace(topology=None, collective_timeout=None, checkpoint_folders=lambda: [str(folder)]))  # type: ignore[arg-type]
    other_folder = tmp_path / "elsewhere"
    model = ranker(seed=0)
    foreign = write_checkpoint(model, other_folder / "epoch=9.ckpt", host_state(model))  # ours, but another folder
    with pytest.warns(CheckpointRemovalSkipped, match="not inside the checkpoint folder"):
        io.remove_checkpoint(foreign)
    assert foreign.resolve().is_dir()
    with pytest.warns(CheckpointRemovalSkipped):
        io.remove_checkpoint(str(folder / ".." / ".." / "precious"))
    assert (victim / "thesis.tex").exists()
    io.remove_checkpoint(path)
    assert not os.path.lexists(path)


def test_restored_callback_paths_outside_their_folder_are_dropped() -> None:
    crafted = {"callbacks": {"ModelCheckpoint{'monitor': 'val'}": {
        "best_model_path": "../../precious", "kth_best_model_path": "/etc", "best_k_models": {"../../precious": 0.1},
        "last_model_path": "", "best_model_score": 0.1,
    }}}
    dropped = drop_foreign_checkpoint_paths(crafted)
    state = crafted["callbacks"]["ModelCheckpoint{'monitor': 'val'}"]
    assert len(dropped) == 3 and any("precious" in d for d in dropped)
    assert state["best_model_path"] == state["kth_best_model_path"] == "" and state["best_k_models"] == {}
    honest = {"callbacks": {"ModelCheckpoint{}": {
        "dirpath": "/runs/ckpts", "best_model_path": "/runs/ckpts/epoch=1.ckpt", "kth_best_model_path": "/runs/ckpts/epoch=0.ckpt",
        "best_k_models": {"/runs/ckpts/epoch=1.ckpt": 0.2, "/runs/ckpts/epoch=0.ckpt": 0.3}, "last_model_path": "/runs/ckpts/last.ckpt",
    }}}
    before = repr(honest)
    assert drop_foreign_checkpoint_paths(honest) == [] and repr(honest) == before
    sneaky = {"callbacks": {"ModelCheckpoint{}": {"dirpath": "/runs/ckpts", "best_model_path": "/runs/ckpts/../../home"}}}
    assert drop_foreign_checkpoint_paths(sneaky) and sneaky["callbacks"]["ModelCheckpoint{}"]["best_model_path"] == ""
