"""The hostile-checkpoint catalogue (crafted_checkpoints.DAMAGES + HOSTILE) on every single-process load path.

For each kind and each load path it reaches: the documented error type and message; the target model
bit-identical, with the same module objects; no class attribute of DCP's index classes changed;
nothing outside the checkpoint directory written or deleted; no export file; no hang (an alarm turns
a blocked open of a FIFO into a failure); and no memory bomb (the process's peak RSS grows by less
than 256 MiB).
"""

from __future__ import annotations

import os
import pickle
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lightning_recsys.testing.crafted_checkpoints import (
    ALL_PATHS,
    DAMAGES,
    HOSTILE,
    Hostile,
    RankerWithExtraState,
    corrupt_error_pattern,
    extra_state_ranker,
    host_state,
    write_checkpoint,
)
from lightning_recsys.checkpoint import CheckpointCorruptError, load_unsharded, to_lightning_checkpoint
from lightning_recsys.checkpoint.safetensors_export import export_safetensors

_CLASSES = [getattr(dcp_metadata, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties")] + [_StorageInfo, torch.Size]


def _load(name: str, path: Path, model: torch.nn.Module) -> Any:
    if name == "load_unsharded":
        return load_unsharded(path, model)
    if name == "to_lightning_checkpoint":
        return to_lightning_checkpoint(path)
    if name == "load_from_checkpoint":
        return RankerWithExtraState.load_from_checkpoint(path)
    if name == "export_safetensors":
        return export_safetensors(path, path.parent / "w.safetensors")
    from lightning_recsys.checkpoint.warm_start import load_weights_unsharded  # here: only this path needs it

    return load_weights_unsharded(path, model)


def _class_state() -> dict[str, dict[str, int]]:
    return {cls.__qualname__: {k: id(v) for k, v in vars(cls).items()} for cls in _CLASSES}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``root`` (not following links) with its size and mtime."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(directory, name))
            out[os.path.relpath(os.path.join(directory, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


@contextmanager
def _no_hang(seconds: int = 30) -> Iterator[None]:
    def fail(*_: Any) -> None:
        raise TimeoutError(f"the load blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _refuses(kind: Hostile | Any, tmp_path: Path, error: type, pattern: str, paths: tuple[str, ...]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not a checkpoint")
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "ckpts" / "last.ckpt", host_state(source))
    kind.apply(path.resolve())
    outside_before, classes_before, rss_before = _tree(outside), _class_state(), _peak_rss_mib()
    for load in paths:
        target = extra_state_ranker(seed=1)
        weights = {k: v.clone() for k, v in target.state_dict().items() if isinstance(v, torch.Tensor)}
        modules = [(n, id(m)) for n, m in target.named_modules()]
        with _no_hang(), pytest.raises(error) as raised:
            _load(load, path, target)
        assert re.search(pattern, str(raised.value), re.S), (load, str(raised.value)[:600])
        after = {k: v for k, v in target.state_dict().items() if isinstance(v, torch.Tensor)}
        assert after.keys() == weights.keys() and all(
            after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in weights.items()
        ), (load, "the model changed")
        assert [(n, id(m)) for n, m in target.named_modules()] == modules, (load, "the module tree changed")
        assert not hasattr(target, "restored_extra"), (load, "the extra state was set")
        assert not (path.parent / "w.safetensors").exists(), (load, "an export was written")
    assert _class_state() == classes_before, "a class attribute changed"
    assert _tree(outside) == outside_before, "something outside the checkpoint changed"
    assert _peak_rss_mib() - rss_before < 256, f"peak RSS grew by {_peak_rss_mib() - rss_before:.0f} MiB"


@pytest.mark.parametrize("kind", [pytest.param(k, id=k.name) for k in HOSTILE])
def test_each_hostile_kind_is_refused_on_every_load_path_with_nothing_changed(tmp_path: Path, kind: Hostile) -> None:
    _refuses(kind, tmp_path, kind.error, kind.pattern, kind.paths)


@pytest.mark.parametrize("damage", [pytest.param(d, id=d.name) for d in DAMAGES])
def test_each_damage_kind_is_refused_on_every_load_path_with_nothing_changed(tmp_path: Path, damage: Any) -> None:
    _refuses(damage, tmp_path, CheckpointCorruptError, corrupt_error_pattern(damage), ALL_PATHS[:4])


def test_the_catalogue_has_forty_kinds_or_more_and_no_duplicates() -> None:
    names = [k.name for k in HOSTILE] + [d.name for d in DAMAGES]
    assert len(names) == len(set(names)) and len(names) >= 40 and len(DAMAGES) >= 15


def test_a_deeply_nested_index_is_refused_in_a_subprocess_not_a_segfault(tmp_path: Path) -> None:
    # DCP's own pickle.load builds a set of 500,000 nested tuples and overflows the C stack: the process dies.
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", host_state(source))
    (path.resolve() / ".metadata").write_bytes(b"\x80\x04\x8f(N" + b"\x85" * 500_000 + b"\x90.")
    script = (
        "import sys\nfrom lightning_recsys.checkpoint import to_lightning_checkpoint, CheckpointCorruptError\n"
        f"try:\n    to_lightning_checkpoint({str(path)!r})\nexcept CheckpointCorruptError as e:\n    print('REFUSED', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "REFUSED" in done.stdout and "nest deeper than" in done.stdout, done.stdout[-1000:]


def test_a_refused_build_on_a_class_leaves_later_indexes_readable(tmp_path: Path) -> None:
    # The variant of the issue: a BUILD on Metadata "succeeded" and every index written afterwards was unreadable.
    source = extra_state_ranker(seed=0)
    crafted = write_checkpoint(source, tmp_path / "crafted.ckpt", host_state(source))
    payload = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x0c\x00\x00\x00__getstate__Ns\x86b."
    (crafted.resolve() / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointCorruptError, match="BUILD on the class"):
        to_lightning_checkpoint(crafted)
    later = write_checkpoint(source, tmp_path / "later.ckpt", host_state(source))
    assert set(to_lightning_checkpoint(later)["state_dict"]) >= {"dlrm.over_arch.model.1.bias"}
    assert pickle.loads(pickle.dumps(dcp_metadata.Metadata(state_dict_metadata={}))).state_dict_metadata == {}
