"""The ``ModelLoading`` every ``RecsysModule`` asks (``lightning_recsys.contracts.model_loading``): this package's
checkpoint directories and reshaped tables, wired here so that ``models/`` imports neither ``checkpoint/`` nor ``parallel/``."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from lightning_recsys.checkpoint import to_lightning_checkpoint
from lightning_recsys.contracts.model_loading import register_model_loading
from lightning_recsys.parallel.sharding import RESHAPE_CHECKPOINT_KEY, apply_recorded_reshape

__all__ = ["DirectoryModelLoading"]


class DirectoryModelLoading:
    """Reads a DCP checkpoint directory as one Lightning checkpoint dict; reshapes the tables a checkpoint recorded."""

    def read_checkpoint_directory(self, path: str | os.PathLike[str], *, weights_only: bool | None, trusted: bool) -> dict[str, Any]:
        return to_lightning_checkpoint(path, weights_only=weights_only, trusted=trusted)

    def prepare_module(self, module: nn.Module, checkpoint: dict[str, Any]) -> None:
        # A model the strategy already sharded, or reshaped, is left as it is (apply_recorded_reshape checks).
        apply_recorded_reshape(module, checkpoint.get(RESHAPE_CHECKPOINT_KEY))


register_model_loading(DirectoryModelLoading())
