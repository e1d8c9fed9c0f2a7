"""Weights safe to share: safetensors export, and a crafted pickle in host_state.pt is refused, not run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from lightning_recsys.checkpoint import load_unsharded
from lightning_recsys.checkpoint.directory import HOST_STATE_FILE, CheckpointMeta, commit, prepare_temporary
from lightning_recsys.checkpoint.safetensors_export import export_safetensors
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[11, 7], num_dense_features=3, global_batch_size=8, train_batches=1, val_batches=1, seed=3)


def _ranker(seed: int) -> DLRMRanker:
    torch.manual_seed(seed)
    return DLRMRanker(
        table_sizes=CONFIG.table_sizes, num_dense_features=CONFIG.num_dense_features, embedding_dim=4,
        dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1],
    )


def _checkpoint(model: DLRMRanker, final: Path, host_state: dict) -> Path:
    """A committed checkpoint in the layout TwoDRecStrategy writes (one process, no process group)."""
    tmp = prepare_temporary(final)
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=tmp, no_dist=True)
    torch.save(host_state, tmp / HOST_STATE_FILE)
    meta = CheckpointMeta(step=5, world_size=2, sharding_group_size=2, num_replicas=1, layout="all_to_all_optimized", written_by_ranks=[0, 1])
    commit(tmp, final, meta)
    return final


def _predictions(model: DLRMRanker) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(SyntheticClickLog(CONFIG).global_batch("val", 0))


def test_safetensors_export_loads_into_a_fresh_model_with_the_checkpoints_predictions(tmp_path: Path) -> None:
    source = _ranker(seed=0)
    path = _checkpoint(source, tmp_path / "last.ckpt", {"global_step": 5, "hyper_parameters": dict(source.hparams)})
    from_checkpoint = _ranker(seed=1)
    load_unsharded(path, from_checkpoint)
    output = export_safetensors(path, tmp_path / "export" / "weights.safetensors")
    fresh = _ranker(seed=2)
    assert not torch.equal(_predictions(fresh), _predictions(from_checkpoint)), "the fresh model already predicts the same"
    fresh.load_state_dict(load_file(output))  # strict: every key of the model, nothing else
    assert torch.equal(_predictions(fresh), _predictions(from_checkpoint))
    with safe_open(str(output), framework="pt") as f:
        assert f.metadata()["source_step"] == "5" and f.metadata()["format"] == "lightning_recsys.unsharded_weights"


def test_safetensors_export_names_a_wrong_suffix(tmp_path: Path) -> None:
    path = _checkpoint(_ranker(seed=0), tmp_path / "last.ckpt", {"global_step": 5})
    with pytest.raises(ValueError, match=r"output='.*weights\.pt' must end in \.safetensors"):
        export_safetensors(path, tmp_path / "weights.pt")


class _SideEffect:
    """Unpickling this creates a directory: code a checkpoint's author chose, run by whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """A committed checkpoint whose host_state.pt holds a pickled object with a side effect."""
    marker = tmp_path / "the_payload_ran"
    source = _ranker(seed=0)
    path = _checkpoint(source, tmp_path / "last.ckpt", {"global_step": 5, "hyper_parameters": dict(source.hparams), "x": _SideEffect(marker)})
    assert not marker.exists()
    return path, marker


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(lambda path: load_unsharded(path, _ranker(seed=1)), id="load_unsharded"),
        pytest.param(lambda path: DLRMRanker.load_from_checkpoint(path), id="load_from_checkpoint"),
        pytest.param(lambda path: export_safetensors(path, path.parent / "w.safetensors"), id="export_safetensors"),
    ],
)
def test_a_crafted_pickle_in_the_host_state_is_refused_and_never_runs(crafted: tuple[Path, Path], load) -> None:
    path, marker = crafted
    with pytest.raises(Exception, match="Weights only load failed"):
        load(path)
    assert not marker.exists(), "loading the checkpoint ran the pickled payload"
