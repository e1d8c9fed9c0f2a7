"""Reading a model's checkpoint without the model importing the storage or runtime layers.

``RecsysModule.load_from_checkpoint`` opens this package's checkpoint directories, and ``on_load_checkpoint``
rebuilds the tables a checkpoint recorded as reshaped. Both need code from layers above the models
(``checkpoint/``, ``parallel/``), so the model asks the ``ModelLoading`` registered here. The provider,
``lightning_recsys.strategies.model_loading``, registers itself when it is imported; ``model_loading()``
imports it by name the first time a model asks, so a model works without anyone importing it first.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

from torch import nn

__all__ = ["DEFAULT_PROVIDER", "ModelLoading", "model_loading", "register_model_loading"]

DEFAULT_PROVIDER = "lightning_recsys.strategies.model_loading"


class ModelLoading(Protocol):
    """What a model needs to load a checkpoint of this package."""

    def read_checkpoint_directory(self, path: str | os.PathLike[str], *, weights_only: bool | None, trusted: bool) -> dict[str, Any]:
        """A checkpoint directory as the one dict Lightning's ``load_from_checkpoint`` reads (``state_dict`` and the rest)."""
        ...

    def prepare_module(self, module: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Change an unsharded ``module`` so that ``checkpoint`` loads into it (reshaped tables); nothing else."""
        ...


_registered: ModelLoading | None = None


def register_model_loading(provider: ModelLoading) -> None:
    """Make ``provider`` the one every model asks (the last registration wins)."""
    global _registered
    _registered = provider


def model_loading() -> ModelLoading:
    """The registered provider, importing ``DEFAULT_PROVIDER`` (which registers itself) the first time."""
    if _registered is None:
        importlib.import_module(DEFAULT_PROVIDER)
    if _registered is None:
        raise RuntimeError(f"{DEFAULT_PROVIDER} did not register a ModelLoading (register_model_loading); it must, when imported.")
    return _registered
