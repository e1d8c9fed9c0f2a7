"""The tensor functions of ``SequenceRanker``'s forward, each one leaf of TorchRec's pipeline fx trace.

``SequenceRanker`` calls them as ``sequence_ops.<name>``: ``torch.fx.wrap`` patches this module's
globals while tracing, so a name imported into another module would be traced through, not kept whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_recsys.contracts.length_rules import FeatureLengthRules, length_rule_problems


@torch.fx.wrap  # data-dependent shapes: TorchRec's pipeline fx-traces forward, and keeps this call whole
def newest_padded(lengths: torch.Tensor, values: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The newest ``max_length`` rows of each example of a jagged ``values [sum(lengths), W]``, right-aligned.

    TorchRec's ``JaggedTensor.to_padded_dense(desired_length)`` keeps the first values of each example;
    a history is stored oldest first, so that would drop the newest actions. Here slot ``j`` of example
    ``i`` holds value ``end_i - max_length + j`` (``end_i`` its offset end): the newest value is always in
    the last slot, the oldest kept one ``min(length, max_length)`` slots earlier, and the slots before it
    are zeros. One gather, no loop over examples.

    Returns ``(padded [B, max_length, W], padding_mask [B, max_length])``; the mask is True on padding
    (``nn.TransformerEncoder``'s ``src_key_padding_mask`` convention).
    """
    lengths = lengths.long()
    ends = torch.cumsum(lengths, 0)
    slots = torch.arange(max_length, device=lengths.device)
    kept = lengths.clamp(max=max_length)
    valid = slots[None, :] >= (max_length - kept)[:, None]
    # Row 0 of the gathered tensor is a zero row: every padding slot reads it (also when values is empty).
    index = torch.where(valid, ends[:, None] - max_length + slots[None, :] + 1, 0)
    with_zero_row = torch.cat([values.new_zeros(1, values.shape[1]), values])
    return with_zero_row[index], ~valid


@torch.fx.wrap
def check_lengths(sparse: KeyedJaggedTensor, rules: FeatureLengthRules) -> None:
    """Raise ``ValueError`` where the batch breaks the model's length rules. Under TwoDRecStrategy its
    input guard checks the same rules on every rank before the step (unless ``validate_inputs="off"``),
    so every rank raises together and this never fires."""
    problems = length_rule_problems([rules], sparse.keys(), sparse.lengths(), sparse.stride())
    if problems:
        raise ValueError("; ".join(problems))


@torch.fx.wrap
def pool_tokens(encoded: torch.Tensor, padding: torch.Tensor, newest_tokens: int) -> torch.Tensor:
    """Max over each example's valid tokens (zeros for an empty history), then its newest tokens flattened.

    Padding slots of the newest tokens are zeros, so a short history reads the same whatever the
    encoder made of its padding.
    """
    valid = ~padding[..., None]
    pooled = encoded.masked_fill(~valid, float("-inf")).amax(dim=1)
    pooled = torch.where(valid.any(dim=1), pooled, torch.zeros_like(pooled))
    newest = (encoded * valid)[:, encoded.shape[1] - newest_tokens :].flatten(1)
    return torch.cat([pooled, newest], dim=1)


@torch.fx.wrap
def attendable(padding: torch.Tensor) -> torch.Tensor:
    """The padding mask with the newest slot of an empty history unmasked.

    Attention over a row with every key masked is a softmax over only ``-inf``: NaN, which would
    also reach the gradients. The unmasked slot holds a zero token (plus its position embedding);
    ``pool_tokens`` still treats it as padding.
    """
    empty = padding.all(dim=1)
    newest_is_key = torch.zeros_like(padding)
    newest_is_key[:, -1] = empty
    return padding & ~newest_is_key


@torch.fx.wrap  # random and data-dependent: one leaf for TorchRec's pipeline tracing
def drop_histories(padding: torch.Tensor, probability: float) -> torch.Tensor:
    """The padding mask with each example's whole history masked with ``probability`` (training only).

    The model then also learns the empty-history case (a new user), which training data alone
    shows rarely: every user's first ratings only.
    """
    dropped = torch.rand(padding.shape[0], device=padding.device) < probability
    return padding | dropped[:, None]


@torch.fx.wrap  # one leaf for TorchRec's pipeline tracing: it reads the batch's action ids
def padded_actions(sparse: KeyedJaggedTensor, action_feature: str, max_length: int) -> torch.Tensor:
    """The batch's ``action_feature`` ids laid out as ``newest_padded`` lays out the history: ``[B, max_length]``, 0 on padding."""
    actions = sparse[action_feature]
    ids, _ = newest_padded(actions.lengths(), actions.values()[:, None], max_length)
    return ids.squeeze(-1).long()


@torch.fx.wrap
def mean_per_action(actions: torch.Tensor, items: torch.Tensor, padding: torch.Tensor, num_actions: int) -> torch.Tensor:
    """The mean item embedding of each action type's kept slots: ``[B, num_actions, dim]`` (zeros where none).

    ``items [B, L, dim]``, ``padding [B, L]`` and ``actions [B, L]`` are the padded history
    (``newest_padded``, ``padded_actions``).
    """
    member = nn.functional.one_hot(actions.clamp(0, num_actions - 1), num_actions).to(items.dtype)
    member = member * (~padding)[..., None].to(items.dtype)
    sums = torch.einsum("bla,bld->bad", member, items)
    return sums / member.sum(dim=1).clamp(min=1.0)[..., None]


@torch.fx.wrap
def action_prediction_loss(
    items: torch.Tensor, actions: torch.Tensor, padding: torch.Tensor, positive_actions: torch.Tensor,
    scale: torch.Tensor, bias: torch.Tensor,
) -> torch.Tensor:
    """Self-supervised loss on the history: does the user act positively on each of its items?

    Each kept item ``i`` of an example is scored ``scale * <item_i, mean of the example's other positive
    items> + bias`` and labelled positive if its action is one of ``positive_actions``; binary
    cross-entropy over the items that have at least one other positive item beside them. The loss is
    the mean over examples of each example's mean (an example with no such item adds 0), so it is
    the same on a whole batch as averaged over equal slices of it (data parallel ranks).

    ``items [B, L, dim]``, ``actions [B, L]`` and ``padding [B, L]`` are the padded history.
    """
    positive = torch.isin(actions, positive_actions) & ~padding
    weight = positive.to(items.dtype)
    positive_sum = torch.einsum("bl,bld->bd", weight, items)
    others = weight.sum(dim=1, keepdim=True) - weight  # [B, L]: the other positive items of each slot's example
    others_mean = (positive_sum[:, None, :] - weight[..., None] * items) / others.clamp(min=1.0)[..., None]
    logits = scale * (items * others_mean).sum(dim=-1) + bias
    scored = (~padding & (others > 0)).to(items.dtype)
    losses = F.binary_cross_entropy_with_logits(logits, weight, reduction="none") * scored
    per_example = losses.sum(dim=1) / scored.sum(dim=1).clamp(min=1.0)
    return per_example.mean()


@torch.fx.wrap  # a list of a variable number of vectors: fx cannot iterate its proxies
def pairwise_dots(
    rows: torch.Tensor, cols: torch.Tensor, candidate: torch.Tensor, history: torch.Tensor, means: torch.Tensor | None,
    context: torch.Tensor | None, dense: torch.Tensor | None,
) -> torch.Tensor:
    """DLRM's interaction: the dot of each pair ``(rows[k], cols[k])`` of ``[candidate, history, means.., contexts.., dense]``."""
    batch, dim = candidate.shape
    vectors = [candidate[:, None], history[:, None]]
    if means is not None:
        vectors.append(means)
    if context is not None:
        vectors.append(context.view(batch, -1, dim))
    if dense is not None:
        vectors.append(dense[:, None])
    stacked = torch.cat(vectors, dim=1)
    return torch.bmm(stacked, stacked.transpose(1, 2))[:, rows, cols]


@torch.fx.wrap
def candidate_last(lengths: torch.Tensor, history: torch.Tensor, candidate: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each example's newest ``max_length - 1`` history rows, oldest first, then its candidate row, padded on the right.

    ``history [sum(lengths), D]`` is jagged (oldest first), ``candidate [B, D]`` one row per example.
    Slot 0 holds the oldest kept history row; the candidate sits right after the newest one (slot 0
    for an empty history), the slots after it are zeros: the layout of ``SASRecEncoder``'s input,
    so under its causal mask the candidate attends to the whole kept history (PinFM's appended candidate).
    Returns ``(tokens [B, max_length, D], valid [B, max_length], candidate_slot [B])``.
    """
    lengths = lengths.long()
    batch = lengths.shape[0]
    kept = lengths.clamp(max=max_length - 1)
    starts = torch.cumsum(lengths, 0) - kept  # the oldest kept row of each example
    slots = torch.arange(max_length, device=lengths.device)
    from_history = slots[None, :] < kept[:, None]
    # Row 0 is zeros (padding), rows 1..: history, then the candidates: one gather builds every slot.
    rows = torch.cat([history.new_zeros(1, history.shape[1]), history, candidate])
    index = torch.where(from_history, starts[:, None] + slots[None, :] + 1, 0)
    index[torch.arange(batch, device=lengths.device), kept] = 1 + history.shape[0] + torch.arange(batch, device=lengths.device)
    return rows[index], slots[None, :] <= kept[:, None], kept


@torch.fx.wrap
def at_slots(hidden: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``hidden [B, L, D]`` at slot ``slots[b]`` of each example ``b``: ``[B, D]``."""
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), slots]
