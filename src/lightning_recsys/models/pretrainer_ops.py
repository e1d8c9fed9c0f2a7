"""The tensor functions of ``SequencePretrainer``: padding, feature checks and the sampled softmax loss.

``SequencePretrainer`` calls them as ``pretrainer_ops.<name>``: ``torch.fx.wrap`` patches this
module's globals while TorchRec's pipeline traces ``forward``, so each stays one leaf of the trace
(data-dependent shapes cannot be traced through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@torch.fx.wrap  # data-dependent shapes: one leaf of TorchRec's pipeline fx trace
def oldest_first_padded(lengths: torch.Tensor, values: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's newest ``max_length`` rows of a jagged ``values [sum(lengths), *W]``, oldest first, padded on the right.

    Slot 0 holds the oldest kept value, slot ``min(length, max_length) - 1`` the newest, and later
    slots are zeros. (TorchRec's ``JaggedTensor.to_padded_dense(desired_length)`` keeps the *first*
    values of a longer example; a sequence stored oldest first must keep its newest.)
    Returns ``(padded [B, max_length, *W], valid [B, max_length])``, ``valid`` True on the kept values.
    """
    lengths = lengths.long()
    starts = torch.cumsum(lengths, 0) - lengths
    kept = lengths.clamp(max=max_length)
    slots = torch.arange(max_length, device=lengths.device)
    valid = slots[None, :] < kept[:, None]
    # Row 0 of the gathered tensor is zeros: every padding slot reads it (also when values is empty).
    first = starts + lengths - kept  # the oldest kept value of each example
    index = torch.where(valid, first[:, None] + slots[None, :] + 1, 0)
    with_zero_row = torch.cat([values.new_zeros((1, *values.shape[1:])), values])
    return with_zero_row[index], valid


@torch.fx.wrap  # data-dependent shapes, and None without timestamps: one leaf of the trace
def padded_timestamps(lengths: torch.Tensor, timestamps: torch.Tensor | None, num_items: int, max_length: int, owner: str) -> torch.Tensor | None:
    """The batch's ``timestamps`` (one per input item) in the slots ``oldest_first_padded`` gives the items: ``[B, max_length]``
    int64, 0 on padding; ``None`` without timestamps. ``num_items``: how many input items the batch has."""
    if timestamps is None:
        return None
    if timestamps.shape != (num_items,):
        raise ValueError(
            f"{owner}: the batch's timestamps have shape {tuple(timestamps.shape)}, but there must be one per input item "
            f"({num_items}, aligned with item_id's values)."
        )
    padded, _ = oldest_first_padded(lengths, timestamps.long(), max_length)
    return padded


@torch.fx.wrap
def check_features(sparse: KeyedJaggedTensor, required: list[str], owner: str) -> None:
    """Raise ``ValueError`` naming the features of ``required`` that the batch's KJT lacks."""
    keys = sparse.keys()
    missing = [name for name in required if name not in keys]
    if missing:
        raise ValueError(
            f"{owner} needs the sparse features {required} in every batch (a SequenceBatch), but the batch's "
            f"KeyedJaggedTensor has no {missing} (its keys: {keys}). 'next_item_id' holds the same ids as "
            "next_item_ids, with item_id's lengths: the targets are looked up in the item table with the inputs."
        )


@torch.fx.wrap
def last_valid(hidden: torch.Tensor, valid: torch.Tensor, owner: str) -> torch.Tensor:
    """``hidden [B, L, D]`` at each example's last valid slot: ``[B, D]``; an example with no valid slot is an error."""
    counts = valid.sum(dim=1)
    if bool((counts == 0).any()):
        example = int(torch.nonzero(counts == 0)[0])
        raise ValueError(
            f"{owner}: example {example} of an evaluation or predict batch has no input item, so it has no query "
            "(the output after its last item) and no target; give every evaluated user at least one input item."
        )
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), counts - 1]


@torch.fx.wrap
def last_entries(lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The last value of each example of a jagged ``values`` (every length >= 1)."""
    return values[torch.cumsum(lengths.long(), 0) - 1]


def sampled_softmax_loss(
    queries: torch.Tensor,
    target_ids: torch.Tensor,
    targets: torch.Tensor,
    pool_ids: torch.Tensor,
    pool: torch.Tensor,
    *,
    temperature: float = 1.0,
    l2_normalize: bool = False,
    in_batch_negatives: bool = False,
) -> torch.Tensor:
    """Sampled softmax (InfoNCE) of each query's target against a shared pool of negatives, averaged over the queries.

    Args:
        queries: ``[M, D]``, one per valid position of the batch.
        target_ids, targets: ``[M]`` the item each query must predict and ``[M, D]`` its embedding.
        pool_ids, pool: ``[N]`` the shared negatives and ``[N, D]`` their embeddings.
        temperature: every logit is divided by it.
        l2_normalize: normalise the queries and the item embeddings first (cosine scores).
        in_batch_negatives: also score every query against the other queries' targets, each
            logit minus ``log`` of that item's share of the ``M`` targets (the logQ correction of
            Yi et al., RecSys 2019: frequent targets are sampled more often as in-batch negatives).

    The logits of query ``i`` are ``[q_i·e(y_i), q_i·e(n_1) .. q_i·e(n_N)] / temperature`` (then the
    in-batch ones); a negative equal to the target (an accidental hit) is ``-inf``, so with the pool
    = every item this is the full softmax. The loss is the cross-entropy for column 0, summed over
    the queries and divided by ``max(M, 1)`` (0, still attached to the graph, when ``M == 0``).
    """
    if l2_normalize:
        queries, targets, pool = F.normalize(queries, dim=-1), F.normalize(targets, dim=-1), F.normalize(pool, dim=-1)
    positive = (queries * targets).sum(dim=-1, keepdim=True) / temperature
    negative = (queries @ pool.T / temperature).masked_fill(pool_ids[None, :] == target_ids[:, None], -torch.inf)
    columns = [positive, negative]
    if in_batch_negatives:
        _, inverse, counts = torch.unique(target_ids, return_inverse=True, return_counts=True)
        log_share = torch.log(counts[inverse].to(queries.dtype) / max(target_ids.numel(), 1))
        in_batch = queries @ targets.T / temperature - log_share[None, :]
        columns.append(in_batch.masked_fill(target_ids[None, :] == target_ids[:, None], -torch.inf))
    logits = torch.cat(columns, dim=1)
    losses = torch.logsumexp(logits, dim=1) - logits[:, 0]
    return losses.sum() / max(queries.shape[0], 1)


@torch.fx.wrap
def valid_rows(padded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The rows of ``padded [B, L, *W]`` at ``valid`` slots, example by example: ``[M, *W]``."""
    return padded[valid]
