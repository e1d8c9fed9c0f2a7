"""Export a checkpoint's unsharded weights as safetensors: a file that loads without executing code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from lightning_recsys.checkpoint.unsharded import to_lightning_checkpoint
from lightning_recsys.checkpoint.directory import read_meta, resolve


def export_safetensors(path: str | os.PathLike[str], output: str | os.PathLike[str], *, trusted: bool = False) -> Path:
    """Write the model weights of checkpoint ``path`` (every table whole) to the safetensors file ``output``.

    The keys are the unsharded module's ``state_dict()`` names, so
    ``module.load_state_dict(safetensors.torch.load_file(output))`` restores the model (built with
    real, not meta, tables). Optimizer and trainer state are not exported. Reads the checkpoint's
    host state with ``weights_only=True``. The file's metadata holds the source checkpoint's step,
    topology and versions. Returns ``output``; needs memory for the whole model. The checkpoint is read as
    ``to_lightning_checkpoint`` reads it: no code from it runs unless ``trusted=True``.
    """
    output = Path(output)
    if output.suffix != ".safetensors":
        raise ValueError(f"output={str(output)!r} must end in .safetensors (the file export_safetensors writes).")
    directory = resolve(path)  # the newest committed copy of this name
    meta = read_meta(directory)
    state_dict = to_lightning_checkpoint(directory, weights_only=True, trusted=trusted)["state_dict"]
    not_tensors = sorted(k for k, v in state_dict.items() if v is not None and not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(
            f"checkpoint {str(directory)!r} holds model state that is not a tensor ({not_tensors[:5]}); safetensors stores "
            "tensors only. Export the weights with to_lightning_checkpoint() instead."
        )
    # safetensors refuses tensors that share memory or are not contiguous: give each its own copy.
    tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    metadata = {
        "format": "lightning_recsys.unsharded_weights",
        "source_step": json.dumps(meta.step),
        "source_topology": json.dumps({"world_size": meta.world_size, "sharding_group_size": meta.sharding_group_size}),
        "source_versions": json.dumps(meta.versions, sort_keys=True),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output), metadata=metadata)
    return output
