"""Weights safe to share: safetensors export, and a crafted pickle in host_state.pt is refused, not run."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from crafted_checkpoints import SideEffect, predictions, ranker, write_checkpoint

from lightning_recsys.checkpoint import load_unsharded
from lightning_recsys.checkpoint.safetensors_export import export_safetensors
from lightning_recsys.models import DLRMRanker



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
