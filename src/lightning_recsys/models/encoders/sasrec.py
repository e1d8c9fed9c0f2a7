"""SASRecEncoder: SASRec's causal transformer (Kang & McAuley, ICDM 2018) laid out as SASRec+, a ``SequenceEncoder``."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_recsys.models.encoders.options import check_int, check_positive, check_probability

__all__ = ["SASRecBlock", "SASRecEncoder"]


class SASRecBlock(nn.Module):
    """One SASRec block, laid out as SASRec+ (``antklen/sasrec-bert4rec-recsys23``, ``src/models.py``, after pmixer's SASRec.pytorch).

    ``q = LayerNorm(x)``; ``x = q + causal self-attention(query q, keys and values x)``; ``x = LayerNorm(x)``;
    ``x = x + Dropout(Linear(Dropout(ReLU(Linear(x)))))`` (SASRec's point-wise feed-forward, its
    kernel-1 convolutions written as ``nn.Linear``).
    """

    def __init__(self, dim: int, num_heads: int, feedforward_dim: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim, eps=1e-8)
        self.attention = nn.MultiheadAttention(dim, num_heads, dropout=dropout, batch_first=True)
        self.feedforward_norm = nn.LayerNorm(dim, eps=1e-8)
        self.feedforward = nn.Sequential(
            nn.Linear(dim, feedforward_dim), nn.Dropout(dropout), nn.ReLU(), nn.Linear(feedforward_dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        query = self.attention_norm(x)
        attended, _ = self.attention(query, x, x, attn_mask=causal_mask, need_weights=False)
        x = self.feedforward_norm(query + attended)
        return x + self.feedforward(x)


class SASRecEncoder(nn.Module):
    """SASRec's encoder over padded item tokens: scale, positions, dropout, causal ``SASRecBlock``s, a final LayerNorm.

    A causal ``SequenceEncoder`` (``lightning_recsys.contracts.encoder``): ``forward(tokens [B, max_length,
    embedding_dim], valid [B, max_length])`` returns ``[B, max_length, embedding_dim]``. Each token is
    ``sqrt(embedding_dim) * tokens + positions[slot]`` (slot 0: the oldest), dropped out and zeroed where
    not ``valid``, then ``num_layers`` blocks under a causal mask. Tokens are padded on the right, so no
    valid slot attends to padding. Timestamps are ignored. Parameters start as SASRec+'s: positions and
    linear weights ``N(0, init_std)``, zero biases.

    Args:
        embedding_dim: the token width (the model's item embedding width); a multiple of ``num_heads``.
        max_length: tokens per example (learned positions).
        num_layers, num_heads: blocks, and attention heads per block.
        feedforward_dim: the hidden width of each block's feed-forward part; default ``embedding_dim`` (SASRec).
        dropout: of the embeddings, the attention weights and the feed-forward part, in ``[0, 1)``.
        init_std: the std of the positions' and linear layers' initial values (SASRec+'s 0.02).
    """

    causal = True

    def __init__(
        self,
        embedding_dim: int,
        max_length: int,
        num_layers: int = 2,
        num_heads: int = 1,
        feedforward_dim: int | None = None,
        dropout: float = 0.1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        check_int("SASRecEncoder", "embedding_dim", embedding_dim)
        check_int("SASRecEncoder", "max_length", max_length)
        check_int("SASRecEncoder", "num_layers", num_layers)
        check_int("SASRecEncoder", "num_heads", num_heads)
        if embedding_dim % num_heads:
            raise ValueError(
                f"SASRecEncoder: num_heads={num_heads} must divide embedding_dim={embedding_dim}: each head attends over an "
                "equal slice. Change num_heads or the model's embedding_dim."
            )
        hidden = embedding_dim if feedforward_dim is None else check_int("SASRecEncoder", "feedforward_dim", feedforward_dim)
        dropout = check_probability("SASRecEncoder", "dropout", dropout)
        init_std = check_positive("SASRecEncoder", "init_std", init_std)
        self.embedding_dim = self.token_dim = self.dim = embedding_dim
        self.max_length = max_length
        self.positions = nn.Parameter(torch.empty(max_length, embedding_dim))
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(SASRecBlock(embedding_dim, num_heads, hidden, dropout) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(embedding_dim, eps=1e-8)
        self.register_buffer("_causal_mask", ~torch.ones(max_length, max_length, dtype=torch.bool).tril(), persistent=False)
        nn.init.normal_(self.positions, std=init_std)
        for module in self.blocks.modules():  # SASRec+'s _init_weights: linear layers N(0, std), zero bias
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        x = tokens * math.sqrt(self.embedding_dim) + self.positions
        x = self.embedding_dropout(x) * valid[..., None]
        for block in self.blocks:
            x = block(x, self._causal_mask)
        return self.final_norm(x)
