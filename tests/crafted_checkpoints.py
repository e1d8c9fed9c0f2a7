"""Small committed checkpoints of a tiny DLRM, written in one process, for the checkpoint security tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from lightning_recsys.checkpoint.directory import HOST_STATE_FILE, CheckpointMeta, commit, prepare_temporary
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[11, 7], num_dense_features=3, global_batch_size=8, train_batches=1, val_batches=1, seed=3)


def ranker(seed: int) -> DLRMRanker:
    torch.manual_seed(seed)
    return DLRMRanker(
        table_sizes=CONFIG.table_sizes, num_dense_features=CONFIG.num_dense_features, embedding_dim=4,
        dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1],
    )


def write_checkpoint(model: DLRMRanker, final: Path, host_state: dict) -> Path:
    """A committed checkpoint in the layout TwoDRecStrategy writes (one process, no process group)."""
    tmp = prepare_temporary(final)
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=tmp, no_dist=True)
    torch.save(host_state, tmp / HOST_STATE_FILE)
    meta = CheckpointMeta(step=5, world_size=2, sharding_group_size=2, num_replicas=1, layout="all_to_all_optimized", written_by_ranks=[0, 1])
    commit(tmp, final, meta)
    return final


def predictions(model: DLRMRanker) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(SyntheticClickLog(CONFIG).global_batch("val", 0))


class SideEffect:
    """Unpickling this creates a directory: code a checkpoint's author chose, run by whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (str(self.marker),))
