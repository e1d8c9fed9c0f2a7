"""SequencePretrainer: a causal sequence encoder (SASRec by default) over a user's items, trained by next-item prediction with sampled negatives."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection

from lightning_recsys.contracts.encoder import EncoderFactory, check_encoder
from lightning_recsys.contracts.length_rules import FeatureLengthRules
from lightning_recsys.contracts.names import (
    ACTION_FEATURE,
    ACTION_TABLE,
    ITEM_FEATURE,
    ITEM_TABLE,
    NEGATIVE_FEATURE,
    NEXT_ITEM_FEATURE,
)
from lightning_recsys.contracts.phases import step_phase
from lightning_recsys.contracts.ranking import ItemRanking, ItemRankingProvider
from lightning_recsys.contracts.warm_start import ENCODER_ROLE, ITEM_TABLE_ROLE, WarmStartPart
from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.models import pretrainer_ops as ops
from lightning_recsys.models import sequence_ops
from lightning_recsys.models.base import DenseOptimizerName, RecsysModule
from lightning_recsys.models.encoders import SASRecBlock, SASRecEncoder, default_encoder_options, encoder_kind, resolve_encoder
from lightning_recsys.models.item_table import ITEM_INIT_STD, item_table_part, sequence_tables
from lightning_recsys.models.ranking_metrics import RankingMetrics
from lightning_recsys.ranking import UnshardedItemRanking

# The names and SASRecEncoder stay importable from here (they were defined here before contracts/ and encoders/).
__all__ = [
    "ACTION_FEATURE", "ACTION_TABLE", "ITEM_FEATURE", "ITEM_TABLE", "NEGATIVE_FEATURE", "NEXT_ITEM_FEATURE", "SASRecBlock",
    "SASRecEncoder", "SequencePretrainer",
]

_OWNER = "SequencePretrainer"
# torch.profiler ranges of a step (opened only while a profiler records), beside the strategy's recsys:* phases.
ENCODER_PHASE = "pretrain:encoder"  # padding the looked-up tokens and the encoder
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


class SequencePretrainer(RecsysModule):
    """Next-item pretraining of a sequence encoder (SASRec by default) with a tied, sharded item table; evaluated by exact full ranking.

    Batches are ``SequenceBatch`` (``lightning_recsys.data.batch``). Its KeyedJaggedTensor holds
    ``item_id`` (each user's input items, oldest first), ``next_item_id`` (the item after each input,
    the same ids as ``next_item_ids``, with ``item_id``'s lengths), ``action`` (one action type per
    input; only with ``num_action_types > 0``) and ``negative_item_id`` (the local batch's shared
    pool of sampled negatives; may be empty in evaluation). ``item_id``, ``next_item_id`` and
    ``negative_item_id`` read ONE table, ``item`` (one ``EmbeddingCollection``, attribute
    ``item_embeddings``, with the ``action`` table beside it), so targets and negatives go through the
    same sharded lookup and all-to-all as the inputs and their gradients reach only their rows.

    Architecture: each token is ``item embedding + action embedding``, padded on the right to
    ``max_length`` (an example longer than that keeps its newest ``max_length`` items; slot 0: the oldest
    kept item), and goes through ``encoder`` (with the batch's ``timestamps``, where it has them, padded
    into the same slots as ``[B, max_length]`` int64: ``HSTUEncoder``'s time buckets read them), a causal ``SequenceEncoder`` (``lightning_recsys.contracts.encoder``;
    default ``SASRecEncoder``, SASRec+ after Klenitskiy & Vasilev, RecSys 2023), in attribute ``encoder``.
    The output ``h_t`` at position ``t`` scores item ``j`` as ``h_t · e_j`` with the item table's own rows
    (tied input and output); with ``l2_normalize`` both are L2-normalised first (as HSTU). The encoder and
    the item table are this model's warm-start parts (``warm_start_parts``): ``SequenceRanker`` with a causal
    encoder starts from them (``lightning_recsys.callbacks.InitFromCheckpoint(parts=[...])``).

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
        embedding_dim: the width of the item table and of the encoder; a multiple of 4 to be sharded
            (FBGEMM's kernels).
        max_length: how many of each user's newest input items the encoder reads.
        encoder: the encoder, a factory called as ``encoder(embedding_dim, max_length)`` (in a config:
            ``{class_path: lightning_recsys.models.encoders.SASRecEncoder, init_args: {num_layers: 2, ...}}``);
            it must be causal. Default: ``SASRecEncoder`` with the options below.
        num_layers, num_heads, feedforward_dim, dropout: shorthand for the default encoder's options
            (``SASRecEncoder``'s defaults: 2 blocks, 1 head, feed-forward width ``embedding_dim``, dropout 0.1);
            refused beside ``encoder``, whose own ``init_args`` hold them.
        temperature: the loss's logits are divided by it.
        l2_normalize: score with L2-normalised outputs and item rows (cosine), in training and ranking.
        in_batch_negatives: also use the other positions' targets of the local batch as negatives.
        init_std: the item (and action) table starts as ``N(0, init_std)`` (SASRec+'s 0.02), through
            ``EmbeddingConfig.init_fn``, which TorchRec also applies to the shards of a table built with
            ``embedding_device="meta"``; so does the default encoder (its positions and linear layers).
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
        encoder: EncoderFactory | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        feedforward_dim: int | None = None,
        dropout: float | None = None,
        temperature: float = 1.0,
        l2_normalize: bool = False,
        in_batch_negatives: bool = False,
        init_std: float = ITEM_INIT_STD,
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
        shorthand = default_encoder_options(
            _OWNER, encoder, num_layers=num_layers, num_heads=num_heads, feedforward_dim=feedforward_dim, dropout=dropout
        )
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
        factory, record = resolve_encoder(encoder, partial(SASRecEncoder, init_std=init_std, **shorthand), _OWNER)
        if encoder is not None and not isinstance(encoder, Mapping):
            self.hparams["encoder"] = record  # plain data: the checkpoint reloads with torch.load(weights_only=True)

        self.num_items = num_items
        self.max_length = max_length
        self.embedding_dim = embedding_dim
        self.has_actions = num_action_types > 0
        self.item_embeddings = sequence_tables(
            num_items=num_items, num_action_types=num_action_types, embedding_dim=embedding_dim,
            item_features=(ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE), action_features=(ACTION_FEATURE,),
            init_std=init_std, device=device,
        )
        self.required_features = [ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE] + ([ACTION_FEATURE] if self.has_actions else [])
        aligned = (ITEM_FEATURE, NEXT_ITEM_FEATURE) + ((ACTION_FEATURE,) if self.has_actions else ())
        # One target (and one action) per input item: checked here and, sharded, by the strategy's input guard.
        self.sparse_length_rules = FeatureLengthRules(aligned=(aligned,), owner=_OWNER)
        self.encoder = check_encoder(factory(embedding_dim, max_length), embedding_dim=embedding_dim, max_length=max_length, owner=_OWNER)
        if not self.encoder.causal:
            raise ValueError(
                f"{_OWNER}(encoder={type(self.encoder).__name__}): next-item pretraining needs a causal encoder (each output "
                "may see only the items before it); use e.g. lightning_recsys.models.encoders.SASRecEncoder."
            )
        self.ranking_metrics = nn.ModuleDict({stage: RankingMetrics(ks) for stage in ("val", "test")})
        self._evaluation_ranking: ItemRanking | None = None

    def warm_start_parts(self) -> dict[str, WarmStartPart]:
        """The parts another model can start from (``contracts.warm_start``): the encoder and the item table."""
        return {ENCODER_ROLE: WarmStartPart(prefix="encoder.", kind=encoder_kind(self.encoder)), ITEM_TABLE_ROLE: item_table_part("item_embeddings")}

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
            # Each item's time in its token's slot; without times the encoder is called as before (no third argument).
            timestamps = ops.padded_timestamps(items.lengths(), batch.timestamps, tokens.shape[0], self.max_length, _OWNER)
            hidden = self.encoder(padded, valid) if timestamps is None else self.encoder(padded, valid, timestamps)
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
        """The full ranking of the item table: the strategy's, where it is an ``ItemRankingProvider`` (``contracts.ranking``;
        ``TwoDRecStrategy``, which ranks a sharded table), else brute force over this process's whole table."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ItemRankingProvider):
            return strategy.item_ranking(self.item_embeddings, ITEM_TABLE, normalize_rows=self.l2_normalize)
        if not isinstance(self.item_embeddings, EmbeddingCollection):
            raise RuntimeError(
                f"{_OWNER}: the item table is sharded ({type(self.item_embeddings).__name__}) but the Trainer's strategy "
                f"{type(strategy).__name__} is no ItemRankingProvider (lightning_recsys.contracts.ranking); evaluate under "
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
