"""The checkpoint commit survives a kill at every filesystem step (forked children, no process group).

Each case saves a checkpoint (step 2) onto a name that holds an older one (step 1) in a forked
child that dies (``os._exit``) at its k-th filesystem call in ``prepare_temporary`` or ``commit``,
for every k. After each death:

* a search by name (Lightning's ``ckpt_path="last"``) still finds the name, and it is a loadable
  checkpoint of step 1 or 2 (``load_unsharded`` reads the tables of exactly that step);
* what a load reads (``resolve``) never goes back: once step 2 was seen at some k, every later
  k sees step 2 too;
* the next save onto the name recovers first (the name then points at the newest copy), commits
  step 3, and leaves only the name and its data directory behind.
"""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_recsys.checkpoint import directory, load_unsharded, read_meta
from lightning_recsys.checkpoint.directory import CheckpointMeta, commit, prepare_temporary, resolve

KILLED = 17
_FS_CALLS: tuple[tuple[object, str], ...] = (
    (os, "rename"), (os, "replace"), (os, "symlink"), (os, "unlink"), (os, "remove"), (os, "rmdir"), (os, "mkdir"),
    (os, "fsync"), (shutil, "rmtree"), (directory, "_exchange"),
)


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=5, feature_names=["f0"])]
        )
        self.over = nn.Linear(4, 1)


def _model(step: int) -> Ranker:
    torch.manual_seed(step)  # the tables of step s are the ones seeded with s
    return Ranker()


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, world_size=1, sharding_group_size=1, num_replicas=1, layout="all_to_all_optimized",
                          written_by_ranks=[0], saved_at=f"2026-11-01T00:00:0{step}+00:00")


def _save(final: Path, step: int, arm: Callable[[bool], None] = lambda on: None) -> None:
    """What rank 0 does in save_checkpoint, without a process group; ``arm`` brackets the commit steps."""
    arm(True)
    tmp = prepare_temporary(final)
    arm(False)  # DCP's own writes are covered by the crash-inside-write_data test
    dcp.save({f"model.{k}": v for k, v in _model(step).state_dict().items()}, checkpoint_id=tmp, no_dist=True)
    arm(True)
    commit(tmp, final, _meta(step))


def _kill_at(k: int) -> Callable[[bool], None]:
    """Instrument every filesystem call in this (child) process; the k-th armed one exits at once."""
    state = {"armed": False, "calls": 0}

    def counted(fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            if state["armed"]:
                state["calls"] += 1
                if state["calls"] == k:
                    os._exit(KILLED)
            return fn(*args, **kwargs)
        return call

    for owner, name in _FS_CALLS:
        setattr(owner, name, counted(getattr(owner, name)))
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        opener = counted(real_open) if any(c in mode for c in "wax+") else real_open
        return opener(file, mode, *args, **kwargs)

    builtins.open = open_

    def arm(on: bool) -> None:
        state["armed"] = on

    return arm


def _save_in_child(final: Path, step: int, k: int) -> int:
    """Fork; the child saves ``step`` and dies at armed filesystem call k. Returns its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            _save(final, step, _kill_at(k))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _loaded_step(path: Path) -> int:
    """Load ``path`` into a fresh model and say which step's tables it holds (asserting it is exactly one)."""
    model = _model(99)
    loaded = load_unsharded(path, model)
    for step in range(1, 10):
        if all(torch.equal(v, _model(step).state_dict()[k]) for k, v in model.state_dict().items()):
            assert loaded.meta.step == step, f"tables of step {step} under meta step {loaded.meta.step}"
            return step
    raise AssertionError(f"{path} holds tables of no saved step")


def _name_only_view(final: Path) -> int:
    """What a search by name sees: Lightning lists the directory and takes what matches, as a path."""
    assert final.name in os.listdir(final.parent), f"{final.name} is missing: a resume from 'last' would start over"
    return directory._read_meta_at(final).step  # the very entry the name is, without the recovery rule


def _setup(tmp_path: Path, case: str) -> Path:
    final = tmp_path / "last.ckpt"
    if case == "replace":
        _save(final, 1)
    elif case == "replace a real directory":  # the layout before symlinks: <name> is the data directory
        _save(tmp_path / "old", 1)
        shutil.copytree(resolve(tmp_path / "old"), final)
        directory.remove_checkpoint(tmp_path / "old")
    return final


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills forked children")
@pytest.mark.parametrize("case", ["replace", "replace a real directory", "first save"])
def test_a_kill_at_every_filesystem_step_of_a_save_keeps_a_checkpoint_under_the_name(tmp_path: Path, case: str) -> None:
    seen: list[int] = []
    names: list[int | None] = []
    k = 0
    while True:
        k += 1
        run = tmp_path / f"k{k}"
        run.mkdir()
        final = _setup(run, case)
        code = _save_in_child(final, 2, k)
        if code == 0:
            break  # k is past the last filesystem step: the save completed
        assert code == KILLED, f"k={k}: the child failed ({code}) instead of dying at the step"
        if case == "first save" and not (final.exists() or final.is_symlink()):
            by_name = None  # nothing was under the name before this save, and it did not get there yet
        else:
            by_name = _name_only_view(final)
        names.append(by_name)
        loaded = _loaded_step(final) if resolve(final).exists() else None
        assert by_name in ({None, 2} if case == "first save" else {1, 2}), f"k={k}: the name holds step {by_name}"
        assert loaded is None or loaded >= (by_name or 0), f"k={k}: a load ({loaded}) went behind the name ({by_name})"
        seen.append(loaded or 0)
        assert seen == sorted(seen), f"k={k}: a load went back to an older step: {seen}"
        # The next save recovers first: the name then holds the newest copy, as a load would read it.
        tmp = prepare_temporary(final)
        assert (final.exists() and _name_only_view(final) == loaded) or loaded is None, f"k={k}: not recovered"
        shutil.rmtree(tmp)
        _save(final, 3)
        assert _loaded_step(final) == 3 and read_meta(final).step == 3
        assert sorted(os.listdir(run)) == sorted([final.name, os.readlink(final)]), f"k={k}: leftovers {os.listdir(run)}"
    print(f"{case}: killed at each of {k - 1} filesystem steps; step under the name after each kill: {names}; "
          f"step a load read: {seen}")
    assert k > 8, f"only {k - 1} filesystem steps were instrumented"
    assert seen[0] == (0 if case == "first save" else 1) and seen[-1] == 2, seen  # both sides of the commit point were hit
    assert _loaded_step(final) == 2 and read_meta(final).step == 2


def test_without_an_atomic_swap_a_real_directory_is_recovered_from_its_aside_copy(tmp_path: Path, monkeypatch) -> None:
    # Where renameat2(RENAME_EXCHANGE) is unavailable, replacing a pre-symlink directory has one gap.
    monkeypatch.setattr(directory, "_exchange", lambda a, b: False)
    final = _setup(tmp_path, "replace a real directory")
    real_replace = os.replace

    def die_in_the_gap(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(dst) == final:
            raise SystemExit("killed between renaming the directory aside and swapping the symlink in")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", die_in_the_gap)
    with pytest.raises(SystemExit):
        _save(final, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not final.exists() and _loaded_step(final) == 2  # a load finds the newest copy all the same
    prepare_temporary(final)  # the next save puts it back under the name first
    assert _name_only_view(final) == 2


def test_the_earlier_protocols_crash_state_is_recovered_to_the_highest_step(tmp_path: Path) -> None:
    # Killed between its two renames, the earlier protocol left the old copy aside and the new one at
    # the temporary name, and nothing under the name.
    final = tmp_path / "last.ckpt"
    for step, helper in ((4, directory.OLD_PREFIX), (5, directory.TMP_PREFIX)):
        _save(tmp_path / f"s{step}", step)
        shutil.copytree(resolve(tmp_path / f"s{step}"), tmp_path / (helper + directory._name_hash(final)))
        directory.remove_checkpoint(tmp_path / f"s{step}")
    assert _loaded_step(final) == 5
    _save(final, 3)  # an older step must not be written over the recovered copy's name before it is restored
    assert _loaded_step(final) == 3 and sorted(os.listdir(tmp_path)) == sorted([final.name, os.readlink(final)])


def test_removing_a_checkpoint_deletes_its_name_data_and_leftovers_only(tmp_path: Path) -> None:
    from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO

    _save(tmp_path / "epoch=0.ckpt", 1)
    _save(tmp_path / "epoch=1.ckpt", 2)
    kept = os.readlink(tmp_path / "epoch=1.ckpt")
    (tmp_path / (directory.TMP_PREFIX + directory._name_hash(tmp_path / "epoch=0.ckpt"))).mkdir()  # a dead save's leftover
    DCPCheckpointIO().remove_checkpoint(tmp_path / "epoch=0.ckpt")  # what ModelCheckpoint(save_top_k=...) calls
    assert sorted(os.listdir(tmp_path)) == sorted(["epoch=1.ckpt", kept]) and _loaded_step(tmp_path / "epoch=1.ckpt") == 2


def test_a_name_that_modelcheckpoint_linked_elsewhere_loads_the_linked_checkpoint_not_its_old_data(tmp_path: Path) -> None:
    from lightning_recsys.checkpoint import latest_checkpoint

    last = tmp_path / "last.ckpt"
    _save(last, 5)  # save_last=True: last.ckpt -> its own data directory, step 5 (e.g. an earlier run)
    _save(tmp_path / "epoch=0-step=3.ckpt", 3)  # a later run, resumed from an earlier step
    old_data = tmp_path / os.readlink(last)
    # What ModelCheckpoint(save_last="link")._link_checkpoint does: the old data directory stays behind.
    os.remove(last)
    os.symlink("epoch=0-step=3.ckpt", last)
    assert _loaded_step(last) == 3 and read_meta(last).step == 3  # the old copy (step 5) was loaded instead
    assert latest_checkpoint(tmp_path).resolve() == (tmp_path / "epoch=0-step=3.ckpt").resolve()
    # A save of the name that dies after its marker, before its swap, is newer than the link: it still wins.
    crashed = tmp_path / f"{directory.DATA_PREFIX}{directory._name_hash(last)}-crashed"
    _save(tmp_path / "scratch", 7)
    os.rename(tmp_path / os.readlink(tmp_path / "scratch"), crashed)
    os.remove(tmp_path / "scratch")
    assert resolve(last) == crashed and latest_checkpoint(tmp_path) == crashed
    shutil.rmtree(crashed)
    # The next save of the name drops the old data directory.
    _save(last, 8)
    assert not old_data.exists() and _loaded_step(last) == 8
