"""The sequence-encoder protocol: what ``SequencePretrainer`` and ``SequenceRanker`` need from an encoder.

An encoder is a plain ``nn.Module`` (no Lightning, no process group) that turns a padded batch of token
vectors into one output vector per token. The model owns the embedding tables, builds the tokens and reads
the outputs; the encoder owns everything in between (position or time signals, attention, norms). A model
takes an encoder *factory* (``EncoderFactory``): a callable it calls with ``(embedding_dim, max_length)``,
so the model's own arguments fix the widths and lengths and a config only names the encoder and its own
options. ``LightningCLI`` passes a class this way::

    encoder:
      class_path: lightning_recsys.models.encoders.SASRecEncoder
      init_args: {num_layers: 2, num_heads: 1, dropout: 0.2}

Inputs of ``forward(tokens, valid, timestamps=None)``:

- ``tokens [B, max_length, token_dim]``: float, zeros on padding.
- ``valid [B, max_length]``: bool, True on the real tokens.
- ``timestamps [B, max_length]`` or None: int64 seconds of each token (any value on padding); an encoder
  that has no use for them ignores them.

The layout depends on ``causal``:

- ``causal = True`` (SASRec, HSTU): oldest token in slot 0, padding on the right (``valid`` is a prefix of
  each row), and the output at slot ``t`` depends only on the valid tokens ``0..t``. Next-item pretraining
  reads every slot; ``SequenceRanker`` appends the candidate after the history and reads its slot.
  ``token_dim == embedding_dim``.
- ``causal = False`` (the TransAct-like encoder): newest token in the last slot, padding on the left
  (``valid`` is a suffix), every valid token sees every other; ``SequenceRanker`` fuses the candidate into
  each token: ``[item, action, candidate]``, so ``token_dim == 3 * embedding_dim``.

Output: ``[B, max_length, token_dim]``; whatever the encoder leaves on padding slots is never read, but it
must be finite. Padding must not change the valid slots' outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["EncoderFactory", "SequenceEncoder", "check_encoder"]


@runtime_checkable
class SequenceEncoder(Protocol):
    """A sequence encoder (see this module): an ``nn.Module`` with these attributes and ``forward``."""

    embedding_dim: int  # the width of the model's item embeddings it was built for
    max_length: int  # tokens per example (slots of ``tokens``)
    token_dim: int  # the width of each token in and out (see the layouts above)
    causal: bool  # the layout and attention it implements

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        ...

    def __call__(self, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        ...


# Called by the model as ``factory(embedding_dim, max_length)``: a class, a ``functools.partial`` of one, or
# what LightningCLI makes of ``{class_path: ..., init_args: ...}``. Typed to return an ``nn.Module``: LightningCLI
# checks a class_path against the return type, and a protocol with attributes is no class it can check against;
# the model checks what the factory built (``check_encoder``).
EncoderFactory = Callable[[int, int], nn.Module]


def check_encoder(encoder: object, *, embedding_dim: int, max_length: int, owner: str) -> SequenceEncoder:
    """``encoder`` if it implements the protocol for these sizes, else ``TypeError``/``ValueError`` saying what differs."""
    if not isinstance(encoder, nn.Module):
        raise TypeError(
            f"{owner}(encoder=...) built a {type(encoder).__name__}, not an nn.Module; an encoder factory must return a "
            "module implementing lightning_recsys.contracts.SequenceEncoder (e.g. lightning_recsys.models.encoders.SASRecEncoder)."
        )
    missing = [name for name in ("embedding_dim", "max_length", "token_dim", "causal") if not hasattr(encoder, name)]
    if missing:
        raise TypeError(
            f"{owner}(encoder=...) built {type(encoder).__name__}, which lacks {missing}: a SequenceEncoder states "
            "embedding_dim, max_length, token_dim and causal (lightning_recsys.contracts.encoder)."
        )
    for name, want in (("embedding_dim", embedding_dim), ("max_length", max_length)):
        got = getattr(encoder, name)
        if got != want:
            raise ValueError(
                f"{owner}(encoder=...) built {type(encoder).__name__} with {name}={got}, but the model called it with "
                f"{name}={want}: the factory must build the encoder for the sizes it is called with."
            )
    return encoder  # type: ignore[return-value]
