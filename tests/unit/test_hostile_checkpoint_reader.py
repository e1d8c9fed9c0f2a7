"""The reader's own guarantees beyond the catalogue: what a load says when a file changes under it, and the scan's limits."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_recsys.testing.crafted_checkpoints import _rezip, _record_of, _replace_record, extra_state_ranker, host_state, read_index_trusting, write_checkpoint
from lightning_recsys.checkpoint import CheckpointCorruptError, CheckpointError, load_unsharded, unsharded
from lightning_recsys.checkpoint.index_reader import INDEX_PICKLE
from lightning_recsys.checkpoint.pickle_guard import PickleRefused, scan
from lightning_recsys.checkpoint.records import BYTE_ITEM_PICKLE


def target_keys(data: Path) -> list[str]:
    return [k for k, v in read_index_trusting(data).state_dict_metadata.items() if hasattr(v, "chunks")]


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_a_record_damaged_after_the_checks_with_nothing_copied_names_the_record_not_a_partial_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", host_state(source))
    data = path.resolve()
    for key in [k for k in target_keys(data)]:  # every tensor record: whichever DCP reads first fails
        _replace_record(data, key, _rezip(_record_of(data, key), compress=True))
    target = extra_state_ranker(seed=1)
    before = _tensors(target)
    monkeypatch.setattr(unsharded, "check_storage", lambda metadata, directory: None)  # as if the file changed after it
    with pytest.raises(CheckpointCorruptError, match=r"\.distcp: .*compressed") as raised:
        load_unsharded(path, target)
    assert "partly overwritten" not in str(raised.value)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items()), "the model changed"


def test_a_record_damaged_after_the_checks_once_tensors_were_copied_says_the_model_is_partly_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", host_state(source))
    data = path.resolve()
    last = "over_arch.model.1.bias"  # the shard's last record: DCP reads the others first
    _replace_record(data, last, _rezip(_record_of(data, last), compress=True))
    monkeypatch.setattr(unsharded, "check_storage", lambda metadata, directory: None)
    with pytest.raises(CheckpointError, match=r"(?s)compressed.*The model is partly overwritten"):
        load_unsharded(path, extra_state_ranker(seed=1))


def _pickle_of(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


def test_the_scan_passes_what_torch_save_and_dcp_write() -> None:
    scan(_pickle_of({"a": torch.ones(2), "b": [1, 2.5, "x"], "c": {"d": (None, True)}}), BYTE_ITEM_PICKLE)
    from collections import OrderedDict

    scan(_pickle_of(OrderedDict(w=torch.zeros(3))), BYTE_ITEM_PICKLE)
    from torch.distributed.checkpoint.metadata import Metadata

    scan(pickle.dumps(Metadata(state_dict_metadata={}, planner_data={}, storage_data={})), INDEX_PICKLE)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"\x80\x04N" + b"\x85" * 30 + b".", "nest deeper than 24"),
        (b"\x80\x04N" + b"2\x86" * 20 + b".", "amplification"),
        (b"\x80\x04]q\x00h\x00a.", "changed after it was placed"),
        (b"\x80\x04NN.", "exactly one object"),
        (b"\x80\x04N", "STOP"),
        (b"\x80\x04h\x05.", "memo reference"),
        (b"\x80\x04(ios\nsystem\n.", "opcode INST"),
        (b"\x80\x04\x8c\x02osX\x06\x00\x00\x00system\x93)R.", None),  # STACK_GLOBAL by constant names: the unpickler's allow-list decides
    ],
)
def test_the_scan_refuses_structure_not_names(payload: bytes, problem: str | None) -> None:
    if problem is None:
        scan(payload, INDEX_PICKLE)
        return
    with pytest.raises(PickleRefused, match=problem):
        scan(payload, INDEX_PICKLE)
