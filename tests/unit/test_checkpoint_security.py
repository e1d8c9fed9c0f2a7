"""Loading runs no code from a checkpoint, and a damaged one is named before the model changes.

Safetensors export; a crafted pickle in host_state.pt, in DCP's index or in a byte item is refused,
not run, on every single-process load path; the damage catalogue (crafted_checkpoints.DAMAGES).
"""

from __future__ import annotations

import collections
import importlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_recsys.testing.crafted_checkpoints import (
    DAMAGES,
    Damage,
    RankerWithExtraState,
    SideEffect,
    corrupt_error_pattern,
    craft_byte_item,
    craft_index,
    edit_index,
    extra_state_ranker,
    host_state,
    predictions,
    ranker,
    write_checkpoint,
)

from lightning_recsys.checkpoint import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError, load_unsharded, to_lightning_checkpoint
from lightning_recsys.checkpoint.safe_reading import INDEX_GLOBALS
from lightning_recsys.checkpoint.safetensors_export import export_safetensors
from lightning_recsys.models import DLRMRanker


@dataclass
class Vocabulary:
    """A user's class in a module's extra state: refused until allowed with torch.serialization."""

    size: int


def test_safetensors_export_loads_into_a_fresh_model_with_the_checkpoints_predictions(tmp_path: Path) -> None:
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", {"global_step": 5, "hyper_parameters": dict(source.hparams)})
    from_checkpoint = ranker(seed=1)
    load_unsharded(path, from_checkpoint)
    output = export_safetensors(path, tmp_path / "export" / "weights.safetensors")
    fresh = ranker(seed=2)
    assert not torch.equal(predictions(fresh), predictions(from_checkpoint)), "the fresh model already predicts the same"
    fresh.load_state_dict(load_file(output))  # strict: every key of the model, nothing else
    assert torch.equal(predictions(fresh), predictions(from_checkpoint))
    with safe_open(str(output), framework="pt") as f:
        assert f.metadata()["source_step"] == "5" and f.metadata()["format"] == "lightning_recsys.unsharded_weights"


def test_safetensors_export_names_a_wrong_suffix(tmp_path: Path) -> None:
    path = write_checkpoint(ranker(seed=0), tmp_path / "last.ckpt", {"global_step": 5})
    with pytest.raises(ValueError, match=r"output='.*weights\.pt' must end in \.safetensors"):
        export_safetensors(path, tmp_path / "weights.pt")


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """A committed checkpoint whose host_state.pt holds a pickled object with a side effect."""
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", {"global_step": 5, "hyper_parameters": dict(source.hparams), "x": SideEffect(marker)})
    assert not marker.exists()
    return path, marker


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(lambda path: load_unsharded(path, ranker(seed=1)), id="load_unsharded"),
        pytest.param(lambda path: DLRMRanker.load_from_checkpoint(path), id="load_from_checkpoint"),
        pytest.param(lambda path: export_safetensors(path, path.parent / "w.safetensors"), id="export_safetensors"),
    ],
)
def test_a_crafted_pickle_in_the_host_state_is_refused_and_never_runs(crafted: tuple[Path, Path], load) -> None:
    path, marker = crafted
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load(path)
    assert not marker.exists(), "loading the checkpoint ran the pickled payload"


# ----------------------------------------------------------------- DCP's index and byte items
def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


_host = host_state


class _Paths:
    """Every single-process load path; each takes the checkpoint and the model it may load into."""

    @staticmethod
    def load_unsharded(path: Path, model: torch.nn.Module, **kw) -> object:
        return load_unsharded(path, model, **kw)

    @staticmethod
    def to_lightning_checkpoint(path: Path, model: torch.nn.Module, **kw) -> object:
        return to_lightning_checkpoint(path, **kw)

    @staticmethod
    def load_from_checkpoint(path: Path, model: torch.nn.Module, **kw) -> object:
        return type(model).load_from_checkpoint(path, **kw)

    @staticmethod
    def export_safetensors(path: Path, model: torch.nn.Module, **kw) -> object:
        return export_safetensors(path, path.parent / "w.safetensors", **kw)


    @staticmethod
    def warm_start(path: Path, model: torch.nn.Module, **kw) -> object:
        from lightning_recsys.checkpoint.warm_start import load_weights_unsharded  # imported here: only this path needs it

        return load_weights_unsharded(path, model, **kw)  # InitFromCheckpoint's load outside TwoDRecStrategy


LOAD_PATHS = [pytest.param(getattr(_Paths, name), id=name) for name in ("load_unsharded", "to_lightning_checkpoint", "load_from_checkpoint", "export_safetensors")]
# A warm start reads tensors only (never a byte item), so it meets a crafted index but no crafted byte item.
INDEX_LOAD_PATHS = [*LOAD_PATHS, pytest.param(_Paths.warm_start, id="warm_start")]


@pytest.mark.parametrize("load", INDEX_LOAD_PATHS)
def test_a_crafted_index_is_refused_on_every_load_path_and_never_runs(tmp_path: Path, load) -> None:
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    craft_index(path.resolve(), marker)
    target = ranker(seed=1)
    before = _weights(target)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused to unpickle the global os\.makedirs.*Nothing was loaded.*trusted=True"):
        load(path, target)
    assert not marker.exists(), "loading the checkpoint ran the index's payload"
    assert _unchanged(target, before)
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("load", LOAD_PATHS)
def test_a_crafted_byte_item_is_refused_on_every_load_path_before_any_tensor_is_copied(tmp_path: Path, load) -> None:
    marker = tmp_path / "the_payload_ran"
    source = extra_state_ranker(seed=0)
    path = craft_byte_item(source, tmp_path / "last.ckpt", marker, _host(source))
    target = extra_state_ranker(seed=1)
    before = _weights(target)
    with pytest.raises(UnsafeCheckpointError, match=r"\.distcp: refused to load the item 'model\._extra_state\.vocab_version'.*GLOBAL os\.makedirs.*trusted=True"):
        load(path, target)
    assert not marker.exists(), "loading the checkpoint ran the byte item's payload"
    assert _unchanged(target, before), "a tensor was copied into the model before the byte item was refused"


def test_the_extra_state_our_models_save_still_loads_as_plain_values(tmp_path: Path) -> None:
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    target = extra_state_ranker(seed=1)
    load_unsharded(path, target)
    assert target.restored_extra == {"vocab_version": 7}
    assert torch.equal(predictions(target), predictions(source))
    restored = RankerWithExtraState.load_from_checkpoint(path)
    assert restored.restored_extra == {"vocab_version": 7}


@pytest.mark.parametrize("load", LOAD_PATHS)
def test_trusted_true_is_dcps_own_reading_which_runs_the_payload(tmp_path: Path, load) -> None:
    # What trusted=True gives up: the same checkpoint, loaded trusting it, runs the author's code.
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    craft_index(path.resolve(), marker)
    target = ranker(seed=1)
    result = load(path, target, trusted=True)
    assert marker.exists()
    if isinstance(result, DLRMRanker):  # load_from_checkpoint
        target = result
    if not isinstance(result, (dict, Path)):
        assert torch.equal(predictions(target), predictions(source))


def test_an_allowed_class_in_a_byte_item_loads_once_the_user_allows_it(tmp_path: Path) -> None:
    source = extra_state_ranker(seed=0)
    source.extra = {"vocab": Vocabulary(7)}
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    target = extra_state_ranker(seed=1)
    target.extra = {"vocab": Vocabulary(0)}
    with pytest.raises(UnsafeCheckpointError, match="Vocabulary.*add_safe_globals"):
        load_unsharded(path, target)
    with torch.serialization.safe_globals([Vocabulary]):
        load_unsharded(path, target)
    assert target.restored_extra == {"vocab": Vocabulary(7)}


def test_the_allow_list_is_what_dcp_writes_and_each_entry_resolves(tmp_path: Path) -> None:
    # Record every global the indexes of a plain and an extra-state checkpoint (and bf16/int tensors) hold.
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
            seen.add((module, name))
            return super().find_class(module, name)

    model = extra_state_ranker(seed=0)
    model.register_buffer("counts", torch.zeros(3, dtype=torch.int64))
    model.register_buffer("halves", torch.zeros(2, dtype=torch.bfloat16))
    path = write_checkpoint(model, tmp_path / "last.ckpt", _host(model))
    with open(path.resolve() / ".metadata", "rb") as f:
        Recording(f).load()
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert dtypes == {("torch", "float32"), ("torch", "int64"), ("torch", "bfloat16")}
    assert seen - dtypes <= INDEX_GLOBALS, sorted(seen - dtypes - INDEX_GLOBALS)
    assert len(seen - dtypes) >= 10  # DCP's dataclasses, torch.Size, the layout and memory format, the path
    for module, name in INDEX_GLOBALS:
        assert getattr(importlib.import_module(module), name) is not None


def test_a_global_outside_the_allow_list_is_refused_even_if_harmless(tmp_path: Path) -> None:
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))

    def add(metadata) -> None:  # type: ignore[no-untyped-def]
        metadata.storage_meta.modules = [collections.OrderedDict()]

    edit_index(path.resolve(), add)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle the global collections\.OrderedDict"):
        to_lightning_checkpoint(path)
    assert to_lightning_checkpoint(path, trusted=True)["global_step"] == 5


# ----------------------------------------------------------------- damaged files
@pytest.mark.parametrize("damage", [pytest.param(d, id=d.name) for d in DAMAGES])
def test_each_kind_of_damage_is_named_before_the_model_is_touched(tmp_path: Path, damage: Damage) -> None:
    source = extra_state_ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    damage.apply(path.resolve())
    target = extra_state_ranker(seed=1)
    before = _weights(target)
    with pytest.raises(CheckpointCorruptError, match=corrupt_error_pattern(damage)):
        load_unsharded(path, target)
    assert _unchanged(target, before)
    assert not hasattr(target, "restored_extra")
    with pytest.raises(CheckpointCorruptError, match=corrupt_error_pattern(damage)):
        to_lightning_checkpoint(path)


def test_the_damage_catalogue_has_ten_kinds_or_more() -> None:
    assert len({d.name for d in DAMAGES}) >= 10


def test_dcp_checkpoint_io_validates_trusted() -> None:
    from lightning_recsys.strategies import DCPCheckpointIO

    assert DCPCheckpointIO().trusted is False
    with pytest.raises(ValueError, match="trusted='yes' must be a bool"):
        DCPCheckpointIO(trusted="yes")  # type: ignore[arg-type]


def test_trusted_must_be_a_bool_on_the_load_functions(tmp_path: Path) -> None:
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    with pytest.raises(ValueError, match="trusted='false' must be a bool"):
        load_unsharded(path, ranker(seed=1), trusted="false")  # type: ignore[arg-type]


def test_a_crafted_tensor_record_is_refused_before_the_load_and_never_runs(tmp_path: Path) -> None:
    # The index points a tensor chunk at a torch.save record of a payload appended to the shard.
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", _host(source))
    data = path.resolve()
    buffer = io.BytesIO()
    torch.save(SideEffect(marker), buffer)
    payload = buffer.getvalue()

    def point_at_payload(metadata) -> None:  # type: ignore[no-untyped-def]
        index, info = next((i, v) for i, v in metadata.storage_data.items() if i.offset is not None)
        shard = data / info.relative_path
        info.offset, info.length = shard.stat().st_size, len(payload)
        with open(shard, "ab") as f:
            f.write(payload)

    edit_index(data, point_at_payload)
    target = ranker(seed=1)
    before = _weights(target)
    with pytest.raises(UnsafeCheckpointError, match=r"\.distcp: refused to unpickle the global posix\.makedirs|os\.makedirs"):
        load_unsharded(path, target)
    assert not marker.exists(), "the payload of a tensor record ran"
    assert _unchanged(target, before)
