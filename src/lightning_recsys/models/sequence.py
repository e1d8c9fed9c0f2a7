"""SequenceRanker: a TransAct-style transformer over the user's recent actions, beside pooled context features."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

from lightning_recsys.contracts.encoder import EncoderFactory, check_encoder
from lightning_recsys.contracts.length_rules import FeatureLengthRules
from lightning_recsys.contracts.names import ACTION_TABLE, ITEM_TABLE
from lightning_recsys.contracts.warm_start import ENCODER_ROLE, ITEM_TABLE_ROLE, WarmStartPart
from lightning_recsys.data.batch import RecBatch
from lightning_recsys.models import sequence_ops as ops
from lightning_recsys.models.base import DenseOptimizerName, RankerModule
from lightning_recsys.models.encoders import TransActEncoder, declared_causal, default_encoder_options, encoder_kind, resolve_encoder
from lightning_recsys.models.item_table import ITEM_INIT_STD, item_table_part, sequence_tables
from lightning_recsys.models.sequence_ops import newest_padded

__all__ = ["ACTION_TABLE", "ITEM_TABLE", "SequenceEncoderName", "SequenceRanker", "context_table_name", "newest_padded"]

InteractionName = Literal["concat", "dot"]
SequenceEncoderName = Literal["transact", "sasrec"]  # only to name in the error of the removed sequence_encoder=
_OWNER = "SequenceRanker"


def context_table_name(feature: str) -> str:
    """The pooled context table of ``feature`` (prefixed, so it never collides with the item and action tables)."""
    return f"t_{feature}"


def _mlp(in_features: int, layer_sizes: list[int]) -> nn.Sequential:
    """Linear layers of ``layer_sizes`` with ReLU between them (none after the last, the logit)."""
    layers: list[nn.Module] = []
    for i, size in enumerate(layer_sizes):
        layers.append(nn.Linear(in_features, size))
        if i < len(layer_sizes) - 1:
            layers.append(nn.ReLU())
        in_features = size
    return nn.Sequential(*layers)


def _positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


def _refuse_transact_options(**given_and_default: tuple[object, object]) -> None:
    """``ValueError`` naming each TransAct-only option set away from its default under a causal encoder."""
    changed = {name: given for name, (given, default) in given_and_default.items() if given != default}
    if changed:
        raise ValueError(
            f"{', '.join(f'{k}={v!r}' for k, v in changed.items())}: option(s) of the TransAct-style ranker, which a causal "
            "encoder (the candidate appended to the history, e.g. SASRecEncoder) does not read; leave them at their defaults "
            "or use encoder=lightning_recsys.models.encoders.TransActEncoder."
        )


def _removed_sequence_encoder(value: Any) -> None:
    """``sequence_encoder="transact"|"sasrec"`` was replaced by ``encoder=``: say how to write it now."""
    if value is None:
        return
    name = {"sasrec": "SASRecEncoder", "transact": "TransActEncoder"}.get(value, "SASRecEncoder")
    raise ValueError(
        f"{_OWNER}(sequence_encoder={value!r}) was replaced by encoder=, an encoder module by class_path: "
        f"encoder: {{class_path: lightning_recsys.models.encoders.{name}, init_args: {{num_layers: 2, num_heads: 1}}}} "
        f"(in Python: encoder=functools.partial(lightning_recsys.models.encoders.{name}, num_layers=2)); "
        "the default is TransActEncoder."
    )


class SequenceRanker(RankerModule):
    """A TransAct-style ranker: a transformer over the user's newest actions, fused early with the candidate.

    Inputs (one ``KeyedJaggedTensor`` holds every sparse feature):

    - ``history_item_feature``: the user's earlier items, oldest first and newest last, any length
      (also 0); ``history_action_feature``: one action type per history item (the same lengths);
    - ``candidate_item_feature``: exactly one item id per example, looked up in the same item table
      as the history (one ``EmbeddingConfig`` with both feature names);
    - ``context_feature_names``: pooled features (any lengths), one ``EmbeddingBagCollection`` table each;
    - ``batch.dense``: ``num_dense_features`` floats per example.

    The item and action tables form one ``EmbeddingCollection`` (tables ``item`` and ``action``), the
    context tables one ``EmbeddingBagCollection`` (tables ``t_<feature>``). Of each history the
    newest ``max_history`` actions are kept (newest in the last slot, padding before the oldest).
    Each token is ``[item embedding, action embedding, candidate embedding]`` (early fusion, as in
    Pinterest's TransAct), ``3 * embedding_dim`` wide, plus a learned embedding of its slot (its
    recency), and goes through ``num_layers`` ``nn.TransformerEncoder`` layers with the padding
    masked. The encoder output is max-pooled over the valid tokens and the newest
    ``newest_tokens`` tokens are kept as they are (flattened); both, the candidate embedding,
    the pooled context embeddings and the dense features feed an MLP that gives one logit
    (``action_means`` adds per-action mean item embeddings, ``interaction="dot"`` DLRM's pairwise dots).
    An empty history gives a zero max-pool and zero tokens, never NaN.

    Every history id goes through the embedding lookup (and, sharded, the sequence all-to-all) before
    the newest ``max_history`` are cut: the lookup reads the batch's own features, which keeps the
    sparse-distribution pipeline on. Histories no longer than ``max_history`` send nothing extra.

    The encoder is a module (``encoder=``, a factory called as ``encoder(embedding_dim, max_history)``;
    ``lightning_recsys.contracts.encoder``); the above is the default, ``TransActEncoder``. With a causal
    encoder (``SASRecEncoder``, or any whose ``causal`` is True) the sequence part is instead a
    ``SequencePretrainer``'s: the encoder reads the newest ``max_history - 1`` history items with the
    candidate appended as the last token (as PinFM); its output at the candidate's token, the candidate
    embedding, the pooled context embeddings and the dense features feed the MLP. Each history token is
    ``item embedding + action embedding`` (the candidate's: its item embedding), as the pretrainer's, and
    the tables are built as the pretrainer's (one ``EmbeddingCollection`` in ``item_embeddings`` with
    tables ``item`` and ``action``, none with ``num_action_types=0``). The encoder and the item table are
    this model's warm-start parts (``warm_start_parts``), so ``InitFromCheckpoint(parts=["encoder",
    "item_table"])`` starts them from a ``SequencePretrainer`` checkpoint: build it with the pretrainer's
    ``embedding_dim``, encoder and its options, ``max_length`` (as ``max_history``) and ``num_items`` (as
    ``item_table_size``). The TransAct-only options (``newest_tokens``, ``action_means``,
    ``history_dropout``, ``action_loss_weight``, ``interaction="dot"``) are refused with it.

    Args:
        item_table_size: rows of the item table (ids ``0 .. item_table_size - 1``), shared by the
            history and the candidate.
        num_action_types: rows of the action-type table (ids ``0 .. num_action_types - 1``); 0 only
            with a causal encoder: no action table, and no action feature is read.
        context_feature_names: the pooled context features, one table each; default none.
        context_table_sizes: rows of each context table, in the order of ``context_feature_names``.
        num_dense_features: width of ``batch.dense`` (0: no dense features).
        embedding_dim: the dimension of the item, action and context tables (one ``EmbeddingCollection``
            has one dimension); a multiple of 4 to be sharded (FBGEMM's kernels).
        max_history: how many of each history's newest actions the encoder reads.
        encoder: the sequence encoder's factory (in a config: ``{class_path: lightning_recsys.models.encoders.TransActEncoder,
            init_args: {num_layers: 2, num_heads: 2}}``); default ``TransActEncoder`` with the options below.
        num_layers, num_heads, feedforward_dim, dropout: shorthand for the default encoder's options
            (``TransActEncoder``'s defaults: 2 layers, 2 heads, feed-forward 4x the token width, dropout 0.1);
            refused beside ``encoder``, whose own ``init_args`` hold them.
        newest_tokens: how many of the newest encoded tokens are kept beside the max-pool
            (``0 .. max_history``; 0: the max-pool only); default (None) 10. Left unset with a causal encoder.
        action_means: also summarize the kept history by action type: for each action type the
            mean item embedding of the history items with that action (zeros if none), beside the
            encoder; ``num_action_types`` vectors of ``embedding_dim``. They reach the MLP and, with
            ``interaction="dot"``, the pairwise dots, so "how like the items the user acted on
            positively is the candidate" is one product. Why: where the signal is which items got
            which action, a mean over all history items carries none of it until the encoder has
            learned to tell the actions apart.
        history_dropout: in training, the probability that an example's whole history is hidden
            (treated as empty: encoder, pooling and ``action_means`` all see padding only), in ``[0, 1)``;
            0 (the default) never. Why: training examples almost always have a history (only a user's
            first ratings have none), so without it the model never learns to rank for users with no
            history, e.g. new users in a time split. Evaluation and prediction never drop.
        action_loss_weight: in training, add this times an auxiliary, self-supervised loss on the
            history to the click loss (0, the default: none). The loss asks of each kept history
            item whether the user acted positively on it (its action in ``positive_actions``), scored
            by the item embedding's dot with the mean embedding of the user's other positive items
            (times a learned scale, plus a learned offset); binary cross-entropy, averaged per example
            and then over the batch. It runs on the whole kept history, before ``history_dropout``,
            and gradients reach the item table through the sequence lookup (and its all-to-all,
            sharded). Why: one click label per example teaches the item table little about which
            items go together, while every history holds dozens of labelled items; items that the
            same users act on positively are pulled together, so the candidate's dots with the
            history (``action_means``, ``interaction="dot"``) can tell related items apart. Logged as ``train/action_loss`` and ``train/click_loss`` beside ``train/loss``.
        positive_actions: the action ids that count as a positive action for ``action_loss_weight``
            (required when it is > 0), e.g. ``[3, 4]`` for MovieLens ratings 4 and 5.
        interaction: how the parts meet before the top MLP. ``"concat"``: the MLP reads them
            concatenated. ``"dot"``: as DLRM, also the pairwise dot products among the candidate
            embedding, each context embedding, a linear projection of the pooled history (to
            ``embedding_dim``), each action mean and a linear projection of the dense features (when
            there are any). Production TransAct rankers feed the encoder output into such an explicit
            interaction; it makes e.g. user x candidate a single product instead of something the MLP
            must approximate.
        over_arch_layer_sizes: the top MLP, ending in 1 (the logit); default ``[128, 32, 1]``.
        history_item_feature, history_action_feature, candidate_item_feature: the names of the
            three sequence features in the batch; all distinct, and distinct from the context features.
        sequence_encoder: removed; raises an error that shows the ``encoder=`` to write instead.
        embedding_device: where the tables are built. ``"meta"`` allocates nothing: the sharding
            strategy materializes only this rank's shards (randomly initialized by TorchRec).
        dense_optimizer, dense_lr: see ``RankerModule``.
    """

    def __init__(
        self,
        item_table_size: int,
        num_action_types: int,
        context_feature_names: list[str] | None = None,
        context_table_sizes: list[int] | None = None,
        num_dense_features: int = 0,
        embedding_dim: int = 32,
        max_history: int = 100,
        encoder: EncoderFactory | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        feedforward_dim: int | None = None,
        dropout: float | None = None,
        newest_tokens: int | None = None,
        action_means: bool = False,
        history_dropout: float = 0.0,
        action_loss_weight: float = 0.0,
        positive_actions: list[int] | None = None,
        interaction: InteractionName = "concat",
        over_arch_layer_sizes: list[int] | None = None,
        history_item_feature: str = "history_item_id",
        history_action_feature: str = "history_action",
        candidate_item_feature: str = "candidate_item_id",
        embedding_device: str | None = None,
        dense_optimizer: DenseOptimizerName = "adagrad",
        dense_lr: float = 0.05,
        sequence_encoder: str | None = None,
    ) -> None:
        super().__init__(dense_optimizer=dense_optimizer, dense_lr=dense_lr)
        self.save_hyperparameters()
        _removed_sequence_encoder(sequence_encoder)
        shorthand = default_encoder_options(
            _OWNER, encoder, num_layers=num_layers, num_heads=num_heads, feedforward_dim=feedforward_dim, dropout=dropout
        )
        factory, record = resolve_encoder(encoder, partial(TransActEncoder, **shorthand), _OWNER)
        if encoder is not None and not isinstance(encoder, dict):
            self.hparams["encoder"] = record  # plain data: the checkpoint reloads with torch.load(weights_only=True)
        context_names = [] if context_feature_names is None else list(context_feature_names)
        context_sizes = [] if context_table_sizes is None else list(context_table_sizes)
        over_sizes = [128, 32, 1] if over_arch_layer_sizes is None else list(over_arch_layer_sizes)
        _positive_int("max_history", max_history)
        _positive_int("embedding_dim", embedding_dim)
        built = None
        causal = declared_causal(factory)
        if causal is None:  # a factory that is no class: build it to learn its layout
            built = factory(embedding_dim, max_history)
            causal = bool(getattr(built, "causal", False))
        if causal:
            _refuse_transact_options(
                newest_tokens=(newest_tokens, None), action_means=(action_means, False), history_dropout=(history_dropout, 0.0),
                action_loss_weight=(action_loss_weight, 0.0), interaction=(interaction, "concat"),
            )
            newest_tokens = 0
        elif newest_tokens is None:
            newest_tokens = 10
        _positive_int("item_table_size", item_table_size)
        _positive_int("num_action_types", num_action_types, minimum=0 if causal else 1)
        _positive_int("num_dense_features", num_dense_features, minimum=0)
        if not isinstance(action_means, bool):
            raise ValueError(f"action_means={action_means!r} must be True or False.")
        if interaction not in ("concat", "dot"):
            raise ValueError(f"interaction={interaction!r} is not one of ['concat', 'dot'].")
        if isinstance(newest_tokens, bool) or not isinstance(newest_tokens, int) or not 0 <= newest_tokens <= max_history:
            raise ValueError(f"newest_tokens={newest_tokens!r} must be an integer in [0, max_history={max_history}].")
        if isinstance(history_dropout, bool) or not isinstance(history_dropout, (int, float)) or not 0 <= history_dropout < 1:
            raise ValueError(f"history_dropout={history_dropout!r} must be a probability in [0, 1).")
        if isinstance(action_loss_weight, bool) or not isinstance(action_loss_weight, (int, float)) or not action_loss_weight >= 0:
            raise ValueError(f"action_loss_weight={action_loss_weight!r} must be a number >= 0 (0: no action-prediction loss).")
        positives = [] if positive_actions is None else list(positive_actions)
        if any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < num_action_types for a in positives) or len(set(positives)) != len(positives):
            raise ValueError(
                f"positive_actions={positive_actions!r} must be distinct action ids in [0, num_action_types={num_action_types})."
            )
        if action_loss_weight > 0 and not positives:
            raise ValueError(
                f"action_loss_weight={action_loss_weight} needs positive_actions: the action ids that count as a positive "
                "action on a history item (e.g. [3, 4] for MovieLens ratings 4 and 5)."
            )
        if len(context_names) != len(context_sizes):
            raise ValueError(
                f"context_feature_names has {len(context_names)} entries but context_table_sizes has "
                f"{len(context_sizes)}; pass one table size per context feature."
            )
        if any(isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 for rows in context_sizes):
            raise ValueError(f"context_table_sizes={context_sizes} must all be integers >= 1 (rows per table).")
        has_actions = num_action_types > 0
        sequence_names = [history_item_feature, candidate_item_feature] + ([history_action_feature] if has_actions else [])
        names = sequence_names + context_names
        if any(not isinstance(name, str) or not name for name in names):
            raise ValueError(f"feature names must be non-empty strings; got {names}.")
        if len(set(names)) != len(names):
            duplicates = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(
                f"feature name(s) {duplicates} are used twice among history_item_feature, history_action_feature, "
                f"candidate_item_feature and context_feature_names={context_names}; every feature needs its own name."
            )
        if not over_sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in over_sizes):
            raise ValueError(f"over_arch_layer_sizes={over_sizes} must be a non-empty list of integers >= 1 (or None for the default).")
        if over_sizes[-1] != 1:
            raise ValueError(f"over_arch_layer_sizes={over_sizes} must end in 1 (one logit per example).")
        try:
            device = torch.device(embedding_device) if embedding_device else None
        except RuntimeError as err:  # torch's own message does not name our argument
            raise ValueError(f"embedding_device={embedding_device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'meta'.") from err

        self._sequence_names = (history_item_feature, history_action_feature, candidate_item_feature)
        # One action per history item, one candidate per example: checked here and, sharded, by the input guard.
        self.sparse_length_rules = FeatureLengthRules(
            aligned=((history_item_feature, history_action_feature),) if has_actions else (),
            one_per_example=(candidate_item_feature,),
            owner=_OWNER,
        )
        self.causal_encoder = causal
        self.has_actions = has_actions
        self.max_history = max_history
        self.history_dropout = float(history_dropout)
        self.action_loss_weight = float(action_loss_weight)
        self.register_buffer("_positive_action_ids", torch.tensor(positives, dtype=torch.long), persistent=False)
        # The action-prediction score's scale and offset (training only; nothing else reads them).
        self.action_score = nn.Parameter(torch.tensor([1.0, 0.0])) if action_loss_weight > 0 else None
        self.newest_tokens = newest_tokens
        self.embedding_dim = embedding_dim
        context_embeddings = (
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=context_table_name(name), embedding_dim=embedding_dim, num_embeddings=rows, feature_names=[name])
                    for name, rows in zip(context_names, context_sizes)
                ],
                device=device,
            )
            if context_names
            else None
        )
        # The tables before the encoder: the order the parameters draw their initial values in.
        if causal:
            self.item_embeddings = sequence_tables(
                num_items=item_table_size, num_action_types=num_action_types, embedding_dim=embedding_dim,
                item_features=(history_item_feature, candidate_item_feature), action_features=(history_action_feature,),
                init_std=ITEM_INIT_STD, device=device,
            )
        else:
            self.sequence_embeddings = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name=ITEM_TABLE, embedding_dim=embedding_dim, num_embeddings=item_table_size,
                        feature_names=[history_item_feature, candidate_item_feature],
                    ),
                    EmbeddingConfig(
                        name=ACTION_TABLE, embedding_dim=embedding_dim, num_embeddings=num_action_types,
                        feature_names=[history_action_feature],
                    ),
                ],
                device=device,
            )
        self.context_embeddings = context_embeddings
        self.encoder = check_encoder(
            built if built is not None else factory(embedding_dim, max_history), embedding_dim=embedding_dim, max_length=max_history, owner=_OWNER
        )
        token_width = embedding_dim if causal else 3 * embedding_dim
        if bool(self.encoder.causal) != causal or self.encoder.token_dim != token_width:
            raise ValueError(
                f"{_OWNER}(encoder={type(self.encoder).__name__}) reads {self.encoder.token_dim}-wide tokens "
                f"(causal={self.encoder.causal}); the ranker builds {token_width}-wide ones for a "
                f"{'causal' if causal else 'non-causal'} encoder (lightning_recsys.contracts.encoder)."
            )
        if causal:
            self.over_arch = _mlp((2 + len(context_names)) * embedding_dim + num_dense_features, over_sizes)
            return
        over_in = (1 + newest_tokens) * token_width + (1 + len(context_names)) * embedding_dim + num_dense_features
        self.action_means = action_means
        self._reads_action_ids = action_means or action_loss_weight > 0
        self.num_action_types = num_action_types
        if action_means:
            over_in += num_action_types * embedding_dim
        self.history_projection: nn.Module | None = None
        self.dense_projection: nn.Module | None = None
        if interaction == "dot":
            self.history_projection = nn.Linear((1 + newest_tokens) * token_width, embedding_dim)
            self.dense_projection = nn.Linear(num_dense_features, embedding_dim) if num_dense_features else None
            vectors = 2 + (num_action_types if action_means else 0) + len(context_names) + (1 if num_dense_features else 0)
            rows, cols = torch.triu_indices(vectors, vectors, offset=1)
            self.register_buffer("_pair_rows", rows, persistent=False)
            self.register_buffer("_pair_cols", cols, persistent=False)
            over_in += len(rows)
        self.over_arch = _mlp(over_in, over_sizes)

    def warm_start_parts(self) -> dict[str, WarmStartPart]:
        """The parts a warm start finds by role (``contracts.warm_start``): the encoder and the item table."""
        table = item_table_part("item_embeddings" if self.causal_encoder else "sequence_embeddings")
        return {ENCODER_ROLE: WarmStartPart(prefix="encoder.", kind=encoder_kind(self.encoder)), ITEM_TABLE_ROLE: table}

    def _sasrec_logits(self, batch: RecBatch) -> torch.Tensor:
        """The encoder's output at the appended candidate, with the candidate, context and dense features, through the MLP."""
        history_name, action_name, candidate_name = self._sequence_names
        ops.check_lengths(batch.sparse, self.sparse_length_rules)
        looked_up = self.item_embeddings(batch.sparse)
        history = looked_up[history_name]
        tokens = history.values()
        if self.has_actions:
            tokens = tokens + looked_up[action_name].values()
        candidate = looked_up[candidate_name].values()
        padded, valid, slot = ops.candidate_last(history.lengths(), tokens, candidate, self.max_history)
        hidden = self.encoder(padded, valid)
        features = [ops.at_slots(hidden, slot), candidate]
        if self.context_embeddings is not None:
            features.append(self.context_embeddings(batch.sparse).values())
        features.append(batch.dense)
        return self.over_arch(torch.cat(features, dim=1)).squeeze(-1)

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self._logits_and_action_loss(batch)[0]

    def training_losses(self, batch: RecBatch) -> dict[str, torch.Tensor]:
        """The click loss, plus ``action_loss_weight`` times the history's action-prediction loss when it is on."""
        logits, action_loss = self._logits_and_action_loss(batch)
        click_loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        if action_loss is None:
            return {"loss": click_loss}
        return {"loss": click_loss + self.action_loss_weight * action_loss, "click_loss": click_loss, "action_loss": action_loss}

    def _logits_and_action_loss(self, batch: RecBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits, and in training with ``action_loss_weight > 0`` the action-prediction loss (else None)."""
        if self.causal_encoder:
            return self._sasrec_logits(batch), None
        history_name, action_name, candidate_name = self._sequence_names
        ops.check_lengths(batch.sparse, self.sparse_length_rules)
        sequences = self.sequence_embeddings(batch.sparse)
        history, actions, candidate = sequences[history_name], sequences[action_name], sequences[candidate_name]
        candidate_embedding = candidate.values()
        tokens, padding = ops.newest_padded(history.lengths(), torch.cat([history.values(), actions.values()], dim=1), self.max_history)
        action_ids = ops.padded_actions(batch.sparse, action_name, self.max_history) if self._reads_action_ids else None
        action_loss = None
        if self.training and self.action_loss_weight > 0:  # on the whole history, before any is dropped
            action_loss = ops.action_prediction_loss(
                tokens[..., : self.embedding_dim], action_ids, padding, self._positive_action_ids, self.action_score[0], self.action_score[1]
            )
        if self.training and self.history_dropout > 0:
            padding = ops.drop_histories(padding, self.history_dropout)
            tokens = tokens.masked_fill(padding[..., None], 0.0)
        candidates = candidate_embedding.unsqueeze(1).expand(-1, self.max_history, -1)
        encoded = self.encoder(torch.cat([tokens, candidates], dim=2), ~padding)
        pooled = ops.pool_tokens(encoded, padding, self.newest_tokens)
        features: list[torch.Tensor] = [pooled, candidate_embedding]
        means = None
        if self.action_means:
            means = ops.mean_per_action(action_ids, tokens[..., : self.embedding_dim], padding, self.num_action_types)
            features.append(means.flatten(1))
        context = self.context_embeddings(batch.sparse).values() if self.context_embeddings is not None else None
        if context is not None:
            features.append(context)
        features.append(batch.dense)
        if self.history_projection is not None:
            dense = self.dense_projection(batch.dense) if self.dense_projection is not None else None
            history_vector = self.history_projection(pooled)
            features.append(ops.pairwise_dots(self._pair_rows, self._pair_cols, candidate_embedding, history_vector, means, context, dense))
        return self.over_arch(torch.cat(features, dim=1)).squeeze(-1), action_loss
