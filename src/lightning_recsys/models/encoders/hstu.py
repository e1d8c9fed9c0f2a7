"""HSTUEncoder: the encoder of HSTU ("Actions Speak Louder than Words", Zhai et al., ICML 2024), a ``SequenceEncoder``.

Written from the paper's equations. Each layer, on ``x [B, T, D]``:

    U, V, Q, K = split(SiLU(f1(LayerNorm(x))))                     # pointwise projection
    A[i, j]    = SiLU(Q_i · K_j + rab_pos(i - j) + rab_time(t_i - t_j)) / n   for j <= i, valid j; else 0
    Y          = f2(Dropout(LayerNorm(A V) * U))                     # pointwise transformation, gated by U
    x          = x + Y

Per head. ``A`` is pointwise aggregated attention: SiLU, not softmax, so the weights of a row do not sum
to one and the output grows with how much of the history is relevant. ``n`` is ``max_length``, the
sequence length the encoder is built for: a constant, so an output depends neither on the padding nor
on the tokens after it (the paper normalises by the sequence length; with a per-example length the
output at ``t`` would change when a later item arrives). ``rab_pos`` is a learned bias per head and
relative-position bucket (exact for near positions, logarithmic further away); ``rab_time`` a learned
bias per head and bucket of ``log2(1 + |t_i - t_j|)`` (seconds), added only when timestamps are given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_recsys.models.encoders.options import check_int, check_probability

__all__ = ["HSTUEncoder", "HSTULayer", "position_buckets", "time_buckets"]


def position_buckets(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bucket of each relative distance ``i - j >= 0``: itself below ``num_buckets // 2``, then logarithmic up to
    ``max_distance`` (the last bucket holds everything further)."""
    exact = max(1, num_buckets // 2)
    distance = distance.clamp(min=0)
    far = distance.clamp(min=1).float()
    spread = max(1, num_buckets - exact)
    log_bucket = exact + (torch.log(far / exact) / math.log(max(max_distance, exact + 1) / exact) * spread).long()
    return torch.where(distance < exact, distance, log_bucket).clamp(max=num_buckets - 1)


def time_buckets(gap: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of each time gap (seconds, any sign): ``floor(log2(1 + |gap|))``, the last bucket holding every longer gap."""
    return torch.floor(torch.log2(1.0 + gap.abs().double())).long().clamp(max=num_buckets - 1)


class HSTULayer(nn.Module):
    """One HSTU layer (see the module's equations) over ``num_heads`` heads of ``attention_dim`` (Q, K) and ``linear_dim`` (U, V)."""

    def __init__(self, dim: int, num_heads: int, attention_dim: int, linear_dim: int, dropout: float) -> None:
        super().__init__()
        self.num_heads, self.attention_dim, self.linear_dim = num_heads, attention_dim, linear_dim
        self.input_norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * attention_dim))
        self.output_norm = nn.LayerNorm(num_heads * linear_dim)
        self.output = nn.Linear(num_heads * linear_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, length: int) -> torch.Tensor:
        """``x [B, T, D]``; ``bias [B or 1, H, T, T]`` (relative position and time); ``keep [B, 1, T, T]``: causal and valid keys."""
        batch, slots, _ = x.shape
        h, a, d = self.num_heads, self.attention_dim, self.linear_dim
        u, v, q, k = torch.split(F.silu(self.uvqk(self.input_norm(x))), [h * d, h * d, h * a, h * a], dim=-1)
        q, k, v = (t.view(batch, slots, h, -1).transpose(1, 2) for t in (q, k, v))  # [B, H, T, .]
        weights = F.silu(q @ k.transpose(-1, -2) + bias) * keep / length  # pointwise, not softmax
        attended = (weights @ v).transpose(1, 2).reshape(batch, slots, h * d)
        return x + self.output(self.dropout(self.output_norm(attended) * u))


class HSTUEncoder(nn.Module):
    """HSTU's causal encoder (see the module): ``num_layers`` ``HSTULayer``s with relative position and time biases.

    A causal ``SequenceEncoder`` (``lightning_recsys.contracts.encoder``): ``forward(tokens [B, max_length,
    embedding_dim], valid [B, max_length], timestamps [B, max_length] or None)``, oldest token in slot 0,
    padding on the right. Tokens are dropped out and zeroed on padding; outputs on padding are zeros.

    Args:
        embedding_dim: the token width (the model's item embedding width).
        max_length: tokens per example; also ``n``, the attention's normaliser.
        num_layers, num_heads: layers, and heads per layer.
        attention_dim: the width of each head's Q and K; default ``embedding_dim // num_heads``.
        linear_dim: the width of each head's U and V; default ``embedding_dim // num_heads``.
        dropout: of the input tokens and of each layer's gated output, in ``[0, 1)``.
        num_position_buckets: relative-position buckets (exact below half of them, logarithmic above).
        num_time_buckets: time-gap buckets, ``floor(log2(1 + seconds))`` (32 covers 68 years).
    """

    causal = True

    def __init__(
        self,
        embedding_dim: int,
        max_length: int,
        num_layers: int = 2,
        num_heads: int = 1,
        attention_dim: int | None = None,
        linear_dim: int | None = None,
        dropout: float = 0.2,
        num_position_buckets: int = 32,
        num_time_buckets: int = 32,
    ) -> None:
        super().__init__()
        for name, value in (
            ("embedding_dim", embedding_dim), ("max_length", max_length), ("num_layers", num_layers), ("num_heads", num_heads),
            ("num_position_buckets", num_position_buckets), ("num_time_buckets", num_time_buckets),
        ):
            check_int("HSTUEncoder", name, value)
        per_head = embedding_dim // num_heads
        if attention_dim is None or linear_dim is None:
            if per_head < 1:
                raise ValueError(
                    f"HSTUEncoder: num_heads={num_heads} exceeds embedding_dim={embedding_dim}; with attention_dim and "
                    "linear_dim unset each head gets embedding_dim // num_heads >= 1 columns. Lower num_heads or set both."
                )
        attention_dim = per_head if attention_dim is None else check_int("HSTUEncoder", "attention_dim", attention_dim)
        linear_dim = per_head if linear_dim is None else check_int("HSTUEncoder", "linear_dim", linear_dim)
        dropout = check_probability("HSTUEncoder", "dropout", dropout)
        self.embedding_dim = self.token_dim = embedding_dim
        self.max_length = max_length
        self.num_heads = num_heads
        self.num_position_buckets, self.num_time_buckets = num_position_buckets, num_time_buckets
        self.input_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(HSTULayer(embedding_dim, num_heads, attention_dim, linear_dim, dropout) for _ in range(num_layers))
        # One bias per layer, head and bucket (rab^p and rab^t), starting at zero: no preference until learned.
        self.position_bias = nn.Parameter(torch.zeros(num_layers, num_heads, num_position_buckets))
        self.time_bias = nn.Parameter(torch.zeros(num_layers, num_heads, num_time_buckets))
        slots = torch.arange(max_length)
        distance = slots[:, None] - slots[None, :]
        self.register_buffer("_position_bucket", position_buckets(distance, num_position_buckets, max_length), persistent=False)
        self.register_buffer("_causal", distance >= 0, persistent=False)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        mask = valid[..., None].to(tokens.dtype)
        x = self.input_dropout(tokens) * mask
        keep = (self._causal & valid[:, None, :])[:, None].to(tokens.dtype)  # [B, 1, T, T]: j <= i and j valid
        time_bucket = None
        if timestamps is not None:
            time_bucket = time_buckets(timestamps[:, :, None] - timestamps[:, None, :], self.num_time_buckets)  # [B, T, T]
        for index, layer in enumerate(self.layers):
            bias = self.position_bias[index][:, self._position_bucket][None]  # [1, H, T, T]
            if time_bucket is not None:
                bias = bias + self.time_bias[index][:, time_bucket].permute(1, 0, 2, 3)  # [B, H, T, T]
            x = layer(x, bias, keep, self.max_length) * mask
        return x
