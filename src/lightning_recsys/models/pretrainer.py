"""SequencePretrainer: a SASRec causal transformer over a user's items, trained by next-item prediction with sampled negatives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig

from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.models import pretrainer_ops as ops
from lightning_recsys.models import sequence_ops
from lightning_recsys.models.base import DenseOptimizerName, RecsysModule
from lightning_recsys.models.ranking_metrics import RankingMetrics
from lightning_recsys.parallel.input.length_rules import FeatureLengthRules
from lightning_recsys.parallel.ranking import ItemRanking, UnshardedItemRanking
from lightning_recsys.parallel.step_phases import step_phase

__all__ = [
    "ACTION_FEATURE", "ITEM_FEATURE", "ITEM_TABLE", "NEGATIVE_FEATURE", "NEXT_ITEM_FEATURE", "SASRecBlock", "SASRecEncoder", "SequencePretrainer",
]

ITEM_TABLE = "item"
ACTION_TABLE = "action"
ITEM_FEATURE = "item_id"
NEXT_ITEM_FEATURE = "next_item_id"
NEGATIVE_FEATURE = "negative_item_id"
ACTION_FEATURE = "action"
_OWNER = "SequencePretrainer"
# torch.profiler ranges of a step (opened only while a profiler records), beside the strategy's recsys:* phases.
ENCODER_PHASE = "pretrain:encoder"  # padding the looked-up tokens and the transformer
LOSS_PHASE = "pretrain:loss"  # padding the targets, scores against targets and negatives, the softmax


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")
    return value


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0.")
    return float(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value


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

    ``forward(tokens [B, max_length, dim], valid [B, max_length])`` returns ``[B, max_length, dim]``:
    each token is ``sqrt(dim) * tokens + positions[slot]`` (slot 0: the oldest), dropped out and
    zeroed where not ``valid``, then ``num_layers`` blocks under a causal mask. Tokens must be padded
    on the right (``pretrainer_ops.oldest_first_padded``), so no valid slot attends to padding.
    ``SequencePretrainer`` and ``SequenceRanker(sequence_encoder="sasrec")`` hold it as their
    ``encoder`` attribute, so its parameters have the same names in both and a warm start copies them.
    Parameters start as SASRec+'s: positions and linear weights ``N(0, init_std)``, zero biases.
    """

    def __init__(self, dim: int, max_length: int, num_layers: int, num_heads: int, feedforward_dim: int, dropout: float, init_std: float) -> None:
        super().__init__()
        self.dim = dim
        self.max_length = max_length
        self.positions = nn.Parameter(torch.empty(max_length, dim))
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(SASRecBlock(dim, num_heads, feedforward_dim, dropout) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(dim, eps=1e-8)
        self.register_buffer("_causal_mask", ~torch.ones(max_length, max_length, dtype=torch.bool).tril(), persistent=False)
        nn.init.normal_(self.positions, std=init_std)
        for module in self.blocks.modules():  # SASRec+'s _init_weights: linear layers N(0, std), zero bias
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


class SequencePretrainer(RecsysModule):
    """Next-item pretraining of a SASRec transformer with a tied, sharded item table; evaluated by exact full ranking.

    Batches are ``SequenceBatch`` (``lightning_recsys.data.batch``). Its KeyedJaggedTensor holds
    ``item_id`` (each user's input items, oldest first), ``next_item_id`` (the item after each input,
    the same ids as ``next_item_ids``, with ``item_id``'s lengths), ``action`` (one action type per
    input; only with ``num_action_types > 0``) and ``negative_item_id`` (the local batch's shared
    pool of sampled negatives; may be empty in evaluation). ``item_id``, ``next_item_id`` and
    ``negative_item_id`` read ONE table, ``item`` (one ``EmbeddingCollection``, attribute
    ``item_embeddings``, with the ``action`` table beside it), so targets and negatives go through the
    same sharded lookup and all-to-all as the inputs and their gradients reach only their rows.

    Architecture (SASRec+, Klenitskiy & Vasilev, RecSys 2023): each token is ``sqrt(embedding_dim) *
    (item embedding + action embedding)`` plus a learned position embedding (slot 0: the oldest kept
    item), dropout, then ``num_layers`` ``SASRecBlock``s under a causal mask and a final LayerNorm:
    the ``SASRecEncoder`` in attribute ``encoder``, which ``SequenceRanker(sequence_encoder="sasrec")``
    shares, so a warm start (``lightning_recsys.callbacks.InitFromCheckpoint``) moves it and the item table over.
    Inputs are padded on the right to ``max_length`` (an example longer than that keeps its newest
    ``max_length`` items), so with the causal mask no valid position ever attends to padding. The
    output ``h_t`` at position ``t`` scores item ``j`` as ``h_t · e_j`` with the item table's own rows
    (tied input and output); with ``l2_normalize`` both are L2-normalised first (as HSTU).

    Training (``training_losses``, logged as ``train/loss``): at every valid position, sampled
    softmax over ``[target, pool of negatives]`` (``pretrainer_ops.sampled_softmax_loss``): accidental
    hits masked, logits divided by ``temperature``, optionally the other positions' targets as
    in-batch negatives with logQ correction; averaged over the batch's valid positions. With the pool
    = every item it is the full softmax.

    Validation and test: the query is the output after each user's last input item, the target the
    last entry of its ``next_item_ids``; the target's rank among every item of the table, the user's
    ``seen_ids`` removed (ties count against the target), comes from ``trainer.strategy.item_ranking``
    (sharded) or an ``UnshardedItemRanking`` of the table. Per epoch they log ``{stage}/hr@K`` and
    ``{stage}/ndcg@K`` for each ``K`` in ``eval_k`` and ``{stage}/mrr`` (``RankingMetrics``, exact over
    every user on every rank). No ``{stage}/loss`` is logged: evaluation batches carry no negatives.

    ``predict_step`` returns a dict: ``"user_vectors"`` ``[B, D]``, the query vectors (L2-normalised
    with ``l2_normalize``), and with ``predict_top_k > 0`` also ``"top_k_ids"`` and ``"top_k_scores"``
    ``[B, predict_top_k]``: the best items not in the example's ``seen_ids``, best first (equal scores:
    lower id first).

    Args:
        num_items: rows of the item table (item ids ``0 .. num_items - 1``).
        num_action_types: rows of the action table (0: no actions; the batch has no ``action`` feature).
        embedding_dim: the width of the item table and of the transformer; a multiple of 4 to be
            sharded (FBGEMM's kernels) and of ``num_heads``.
        max_length: how many of each user's newest input items the transformer reads.
        num_layers, num_heads: transformer blocks and attention heads per block.
        feedforward_dim: the hidden width of each block's feed-forward part; default ``embedding_dim`` (SASRec).
        dropout: dropout of the embeddings, the attention weights and the feed-forward part, in ``[0, 1)``.
        temperature: the loss's logits are divided by it.
        l2_normalize: score with L2-normalised outputs and item rows (cosine), in training and ranking.
        in_batch_negatives: also use the other positions' targets of the local batch as negatives.
        init_std: the item (and action) table, position embeddings and linear layers start as
            ``N(0, init_std)`` (SASRec+'s 0.02); the tables through ``EmbeddingConfig.init_fn``, which
            TorchRec also applies to the shards of a table built with ``embedding_device="meta"``.
        eval_k: the cut-offs ``K`` of ``hr@K`` and ``ndcg@K``.
        predict_top_k: how many items ``predict_step`` returns per user (0: only the user vectors).
        embedding_device: where the tables are built; ``"meta"`` allocates nothing and the strategy
            materialises only this rank's shards.
        dense_optimizer, dense_lr: see ``RecsysModule``.
    """

    def __init__(
        self,
        num_items: int,
        num_action_types: int = 0,
        embedding_dim: int = 64,
        max_length: int = 50,
        num_layers: int = 2,
        num_heads: int = 1,
        feedforward_dim: int | None = None,
        dropout: float = 0.1,
        temperature: float = 1.0,
        l2_normalize: bool = False,
        in_batch_negatives: bool = False,
        init_std: float = 0.02,
        eval_k: Sequence[int] = (10, 100),
        predict_top_k: int = 0,
        embedding_device: str | None = None,
        dense_optimizer: DenseOptimizerName = "adam",
        dense_lr: float = 1e-3,
    ) -> None:
        super().__init__(dense_optimizer=dense_optimizer, dense_lr=dense_lr)
        self.save_hyperparameters()
        _integer("num_items", num_items, 1)
        _integer("num_action_types", num_action_types, 0)
        _integer("embedding_dim", embedding_dim, 1)
        _integer("max_length", max_length, 1)
        _integer("num_layers", num_layers, 1)
        _integer("num_heads", num_heads, 1)
        if embedding_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide embedding_dim={embedding_dim}: each head attends over an equal slice.")
        hidden = embedding_dim if feedforward_dim is None else _integer("feedforward_dim", feedforward_dim, 1)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout!r} must be a probability in [0, 1).")
        self.temperature = _positive_float("temperature", temperature)
        self.l2_normalize = _flag("l2_normalize", l2_normalize)
        self.in_batch_negatives = _flag("in_batch_negatives", in_batch_negatives)
        init_std = _positive_float("init_std", init_std)
        ks = list(eval_k) if isinstance(eval_k, (list, tuple)) else eval_k
        if not isinstance(ks, list) or not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks) or len(set(ks)) != len(ks):
            raise ValueError(f"eval_k={eval_k!r} must be a non-empty list of distinct integers >= 1 (the K of hr@K and ndcg@K).")
        self.predict_top_k = _integer("predict_top_k", predict_top_k, 0)
        if predict_top_k > num_items:
            raise ValueError(f"predict_top_k={predict_top_k} must be <= num_items={num_items} (the table has no more items).")
        try:
            device = torch.device(embedding_device) if embedding_device else None
        except RuntimeError as err:  # torch's own message does not name our argument
            raise ValueError(f"embedding_device={embedding_device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'meta'.") from err

        self.num_items = num_items
        self.max_length = max_length
        self.embedding_dim = embedding_dim
        self.has_actions = num_action_types > 0
        initial = partial(nn.init.normal_, mean=0.0, std=init_std)
        tables = [
            EmbeddingConfig(
                name=ITEM_TABLE, embedding_dim=embedding_dim, num_embeddings=num_items,
                feature_names=[ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE], init_fn=initial,
            )
        ]
        if self.has_actions:
            tables.append(
                EmbeddingConfig(
                    name=ACTION_TABLE, embedding_dim=embedding_dim, num_embeddings=num_action_types,
                    feature_names=[ACTION_FEATURE], init_fn=initial,
                )
            )
        self.item_embeddings = EmbeddingCollection(tables=tables, device=device)
        self.required_features = [ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE] + ([ACTION_FEATURE] if self.has_actions else [])
        aligned = (ITEM_FEATURE, NEXT_ITEM_FEATURE) + ((ACTION_FEATURE,) if self.has_actions else ())
        # One target (and one action) per input item: checked here and, sharded, by the strategy's input guard.
        self.sparse_length_rules = FeatureLengthRules(aligned=(aligned,), owner=_OWNER)
        self.encoder = SASRecEncoder(embedding_dim, max_length, num_layers, num_heads, hidden, float(dropout), init_std)
        self.ranking_metrics = nn.ModuleDict({stage: RankingMetrics(ks) for stage in ("val", "test")})
        self._evaluation_ranking: ItemRanking | None = None

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        """The output at every position, ``[B, max_length, embedding_dim]`` (right-padded; not L2-normalised)."""
        return self._encode(batch)[0]

    def _encode(self, batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(hidden [B, L, D], valid [B, L], the lookup's JaggedTensors by feature)``: one lookup for inputs, targets and negatives."""
        ops.check_features(batch.sparse, self.required_features, _OWNER)
        sequence_ops.check_lengths(batch.sparse, self.sparse_length_rules)
        looked_up = self.item_embeddings(batch.sparse)
        items = looked_up[ITEM_FEATURE]
        tokens = items.values()
        if self.has_actions:
            tokens = tokens + looked_up[ACTION_FEATURE].values()
        with step_phase(ENCODER_PHASE):
            padded, valid = ops.oldest_first_padded(items.lengths(), tokens, self.max_length)
            hidden = self.encoder(padded, valid)
        return hidden, valid, looked_up

    def training_losses(self, batch: SequenceBatch) -> dict[str, torch.Tensor]:
        """``{"loss": ...}``: the sampled softmax of every valid position's next item, averaged over the batch's positions."""
        hidden, valid, looked_up = self._encode(batch)
        with step_phase(LOSS_PHASE):
            targets = looked_up[NEXT_ITEM_FEATURE]
            target_ids = batch.sparse[NEXT_ITEM_FEATURE].values()
            padded_ids, _ = ops.oldest_first_padded(targets.lengths(), target_ids, self.max_length)
            padded_targets, _ = ops.oldest_first_padded(targets.lengths(), targets.values(), self.max_length)
            loss = ops.sampled_softmax_loss(
                ops.valid_rows(hidden, valid),
                ops.valid_rows(padded_ids, valid),
                ops.valid_rows(padded_targets, valid),
                batch.sparse[NEGATIVE_FEATURE].values(),
                looked_up[NEGATIVE_FEATURE].values(),
                temperature=self.temperature,
                l2_normalize=self.l2_normalize,
                in_batch_negatives=self.in_batch_negatives,
            )
        return {"loss": loss}

    def user_vectors(self, batch: SequenceBatch) -> torch.Tensor:
        """The query of each example, ``[B, D]``: the output after its last input item (L2-normalised with ``l2_normalize``)."""
        hidden, valid, _ = self._encode(batch)
        queries = ops.last_valid(hidden, valid, _OWNER)
        return F.normalize(queries, dim=-1) if self.l2_normalize else queries

    def item_ranking(self) -> ItemRanking:
        """The full ranking of the item table: the strategy's (``item_ranking``, sharded) or brute force over the whole table."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        sharded = getattr(strategy, "item_ranking", None)
        if callable(sharded):
            return sharded(self.item_embeddings, ITEM_TABLE, normalize_rows=self.l2_normalize)
        if not isinstance(self.item_embeddings, EmbeddingCollection):
            raise RuntimeError(
                f"{_OWNER}: the item table is sharded ({type(self.item_embeddings).__name__}) but the Trainer's strategy "
                f"{type(strategy).__name__} has no item_ranking(module, table_name, normalize_rows=...); evaluate under "
                "TwoDRecStrategy, or load the model unsharded (SequencePretrainer.load_from_checkpoint)."
            )
        weight = self.item_embeddings.embeddings[ITEM_TABLE].weight.detach()
        return UnshardedItemRanking(weight, normalize_rows=self.l2_normalize)

    # The ranking of an evaluation or predict loop (``_evaluation_ranking``, set in __init__): built at its start (the table
    # does not change until it ends), dropped at its end.
    def on_validation_epoch_start(self) -> None:
        self._evaluation_ranking = self.item_ranking()

    def on_test_epoch_start(self) -> None:
        self._evaluation_ranking = self.item_ranking()

    def on_predict_epoch_start(self) -> None:
        self._evaluation_ranking = self.item_ranking() if self.predict_top_k > 0 else None

    def on_predict_epoch_end(self) -> None:
        self._evaluation_ranking = None

    def validation_step(self, batch: SequenceBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: SequenceBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch: SequenceBatch, stage: str) -> None:
        queries = self.user_vectors(batch)
        target_ids = ops.last_entries(batch.sparse[ITEM_FEATURE].lengths(), batch.next_item_ids)
        ranks = self._loop_ranking().target_ranks(queries, target_ids, batch.seen_ids, batch.seen_lengths)
        self.ranking_metrics[stage].update(ranks)

    def _loop_ranking(self) -> ItemRanking:
        # A step called outside a loop (no epoch-start hook) ranks the table as it is now.
        return self._evaluation_ranking if self._evaluation_ranking is not None else self.item_ranking()

    def on_validation_epoch_end(self) -> None:
        self._evaluation_ranking = None
        self._log_ranking("val")

    def on_test_epoch_end(self) -> None:
        self._evaluation_ranking = None
        self._log_ranking("test")

    def _log_ranking(self, stage: str) -> None:
        # compute() adds the sums of every rank (torchmetrics' sync), so the values logged are already global.
        metric = self.ranking_metrics[stage]
        values = metric.compute()
        metric.reset()
        for name, value in values.items():
            # Already summed over every rank by compute(); averaging equal values changes nothing, and
            # without sync_dist Lightning warns about epoch-level logging in distributed runs.
            self.log(f"{stage}/{name}", value.float(), prog_bar=name in ("ndcg@10", "hr@10"), sync_dist=True)

    def predict_step(self, batch: SequenceBatch, batch_idx: int) -> dict[str, torch.Tensor]:
        queries = self.user_vectors(batch)
        out = {"user_vectors": queries}
        if self.predict_top_k > 0:
            scores, ids = self._loop_ranking().top_k(queries, self.predict_top_k, batch.seen_ids, batch.seen_lengths)
            out.update(top_k_ids=ids, top_k_scores=scores)
        return out
