"""TransActEncoder: the TransAct-like encoder of ``SequenceRanker`` (Pinterest's TransAct, KDD 2023), a ``SequenceEncoder``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_recsys.models import sequence_ops as ops
from lightning_recsys.models.encoders.options import check_int, check_probability

__all__ = ["TransActEncoder"]


class TransActEncoder(nn.Module):
    """A bidirectional transformer over early-fused tokens ``[item, action, candidate]``, newest last.

    A non-causal ``SequenceEncoder`` (``lightning_recsys.contracts.encoder``): ``tokens [B, max_length,
    3 * embedding_dim]`` hold, per slot, the history item's, its action's and the candidate's embeddings
    (``SequenceRanker`` builds them), padded on the left so the newest action is in the last slot. A learned
    embedding of each slot (its recency) is added, then ``num_layers`` ``nn.TransformerEncoder`` layers run
    with the padding masked. An empty history unmasks its newest slot (a zero token): attention over keys
    that are all masked is NaN. Timestamps are ignored.

    Args:
        embedding_dim: the model's item embedding width; tokens are ``3 * embedding_dim`` wide, which
            ``num_heads`` must divide.
        max_length: tokens per example (the ranker's ``max_history``).
        num_layers, num_heads: transformer layers, and attention heads per layer.
        feedforward_dim: each layer's feed-forward width; default 4x the token width.
        dropout: the layers' dropout, in ``[0, 1)``.
    """

    causal = False

    def __init__(
        self,
        embedding_dim: int,
        max_length: int,
        num_layers: int = 2,
        num_heads: int = 2,
        feedforward_dim: int | None = None,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value in (("embedding_dim", embedding_dim), ("max_length", max_length), ("num_layers", num_layers), ("num_heads", num_heads)):
            check_int("TransActEncoder", name, value)
        if feedforward_dim is not None:
            check_int("TransActEncoder", "feedforward_dim", feedforward_dim)
        dropout = check_probability("TransActEncoder", "dropout", dropout)
        token_width = 3 * embedding_dim
        if token_width % num_heads:
            raise ValueError(
                f"TransActEncoder: num_heads={num_heads} must divide the token width (3 * embedding_dim={token_width}): each "
                "head attends over an equal slice. Change num_heads or the model's embedding_dim."
            )
        self.embedding_dim = embedding_dim
        self.token_dim = token_width
        self.max_length = max_length
        self.positions = nn.Parameter(torch.zeros(max_length, token_width))  # each slot's (its recency's) embedding
        nn.init.normal_(self.positions, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=token_width,
            nhead=num_heads,
            dim_feedforward=4 * token_width if feedforward_dim is None else feedforward_dim,
            dropout=dropout,
            batch_first=True,
        )
        # No nested tensors: the fast path would turn padding into a nested tensor in evaluation only.
        self.transformer = nn.TransformerEncoder(layer, num_layers=num_layers, enable_nested_tensor=False)

    @property
    def num_layers(self) -> int:
        return self.transformer.num_layers

    @property
    def layers(self) -> nn.ModuleList:
        return self.transformer.layers

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(tokens + self.positions, src_key_padding_mask=ops.attendable(~valid))
