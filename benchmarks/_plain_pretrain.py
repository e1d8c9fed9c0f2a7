"""``SequencePretrainer``'s model and loss in plain PyTorch: ``nn.Embedding`` and torch optimizers, no TorchRec.

What a user writes before adopting TorchRec, and the reference ``overhead.py --workload pretrain``
compares the 2-process fit against. The same SASRec encoder (the layout of SASRec+,
``antklen/sasrec-bert4rec-recsys23``, ``src/models.py``), with the parameter names of
``lightning_recsys.models.SASRecEncoder`` so weights copy across, and the same sampled softmax
(a batch-shared pool of negatives, accidental hits masked, tied output). Batches are padded
ahead (``PlainBatch``), as a plain data loader hands them over.

``tests/unit/test_plain_pretrain.py`` checks that the loss equals ``SequencePretrainer``'s on the same
batch and weights. Profiler labels (only while a profiler records): ``plain:lookup`` (inputs,
targets and negatives in one ``nn.Embedding`` call), ``plain:encoder``, ``plain:loss``.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LOOKUP, ENCODER, LOSS = "plain:lookup", "plain:encoder", "plain:loss"


def _label(name: str) -> AbstractContextManager[Any]:
    # torch's own check (torch/autograd/profiler.py): no range is opened unless a profiler records.
    return torch.autograd.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else nullcontext()


@dataclass
class PlainBatch:
    """One batch, padded on the right, oldest item first: ``item_ids``, ``target_ids`` and ``valid`` ``[B, L]``; ``negative_ids`` ``[N]``."""

    item_ids: torch.Tensor
    target_ids: torch.Tensor
    valid: torch.Tensor
    negative_ids: torch.Tensor


def plain_batch(batch: Any, max_length: int) -> PlainBatch:
    """A ``SequenceBatch`` (its ``item_id``, ``next_item_id`` and ``negative_item_id`` features) padded as ``PlainBatch``.

    ``item_id`` is already cut to each example's newest ``max_length`` items, oldest first.
    """
    items, targets = batch.sparse["item_id"], batch.sparse["next_item_id"]
    lengths = items.lengths().long()
    if lengths.numel() and int(lengths.max()) > max_length:
        raise ValueError(f"an example has {int(lengths.max())} items, more than max_length={max_length}.")
    valid = torch.arange(max_length)[None, :] < lengths[:, None]
    item_ids = torch.zeros(valid.shape, dtype=torch.long)
    target_ids = torch.zeros(valid.shape, dtype=torch.long)
    item_ids[valid] = items.values().long()
    target_ids[valid] = targets.values().long()
    return PlainBatch(item_ids, target_ids, valid, batch.sparse["negative_item_id"].values().long())


class PlainSASRecBlock(nn.Module):
    """``q = LN(x)``; ``x = LN(q + causal attention(q, x, x))``; ``x + FFN(x)``."""

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


class PlainSASRecEncoder(nn.Module):
    """``sqrt(dim) * tokens + positions``, dropout, padding zeroed, causal blocks, a final LayerNorm."""

    def __init__(self, dim: int, max_length: int, num_layers: int, num_heads: int, feedforward_dim: int, dropout: float, init_std: float) -> None:
        super().__init__()
        self.dim = dim
        self.positions = nn.Parameter(torch.empty(max_length, dim))
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(PlainSASRecBlock(dim, num_heads, feedforward_dim, dropout) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(dim, eps=1e-8)
        self.register_buffer("_causal_mask", ~torch.ones(max_length, max_length, dtype=torch.bool).tril(), persistent=False)
        nn.init.normal_(self.positions, std=init_std)
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=init_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = tokens * math.sqrt(self.dim) + self.positions
        x = self.embedding_dropout(x) * valid[..., None]
        for block in self.blocks:
            x = block(x, self._causal_mask)
        return self.final_norm(x)


class PlainSASRec(nn.Module):
    """The item table (``item_embeddings``, tied input and output) and the encoder; ``loss(batch)`` is the training loss.

    ``sparse=True`` gives the table sparse gradients (for ``torch.optim.Adagrad`` or ``SparseAdam``).
    """

    def __init__(
        self, num_items: int, dim: int, max_length: int, num_layers: int, num_heads: int, *, feedforward_dim: int | None = None,
        dropout: float = 0.1, init_std: float = 0.02, sparse: bool = True,
    ) -> None:
        super().__init__()
        self.item_embeddings = nn.Embedding(num_items, dim, sparse=sparse)
        nn.init.normal_(self.item_embeddings.weight, std=init_std)
        self.encoder = PlainSASRecEncoder(dim, max_length, num_layers, num_heads, feedforward_dim or dim, dropout, init_std)

    def loss(self, batch: PlainBatch) -> torch.Tensor:
        """Sampled softmax of each valid position's next item against ``[target, negatives]``, averaged over the positions."""
        valid = batch.valid
        with _label(LOOKUP):  # one lookup for inputs, targets and negatives, as the sharded model does
            inputs, targets = batch.item_ids[valid], batch.target_ids[valid]
            rows = self.item_embeddings(torch.cat([inputs, targets, batch.negative_ids]))
            input_rows, target_rows, pool = rows.split([len(inputs), len(targets), len(batch.negative_ids)])
        with _label(ENCODER):
            tokens = input_rows.new_zeros((*valid.shape, rows.shape[1]))
            tokens[valid] = input_rows
            queries = self.encoder(tokens, valid)[valid]
        with _label(LOSS):
            positive = (queries * target_rows).sum(dim=-1, keepdim=True)
            negative = (queries @ pool.T).masked_fill(batch.negative_ids[None, :] == targets[:, None], -torch.inf)
            logits = torch.cat([positive, negative], dim=1)
            return (torch.logsumexp(logits, dim=1) - logits[:, 0]).sum() / max(queries.shape[0], 1)


def plain_optimizers(model: PlainSASRec, table_optimizer: str, *, table_lr: float, dense_lr: float) -> list[torch.optim.Optimizer]:
    """``"adagrad"``: torch's Adagrad on the (sparse) table and Adam on the rest; ``"adam"``: Adam (``dense_lr``) on everything."""
    table = [model.item_embeddings.weight]
    dense = [p for name, p in model.named_parameters() if not name.startswith("item_embeddings.")]
    if table_optimizer == "adagrad":
        if not model.item_embeddings.sparse:
            raise ValueError("table_optimizer='adagrad' is meant for a sparse table: build PlainSASRec(sparse=True).")
        return [torch.optim.Adagrad(table, lr=table_lr), torch.optim.Adam(dense, lr=dense_lr)]
    if table_optimizer == "adam":
        if model.item_embeddings.sparse:
            raise ValueError("table_optimizer='adam' (dense Adam) needs PlainSASRec(sparse=False).")
        return [torch.optim.Adam(table + dense, lr=dense_lr)]
    raise ValueError(f"table_optimizer={table_optimizer!r} must be 'adagrad' or 'adam'.")
