"""HR@K, NDCG@K and MRR of a full ranking, computed from each user's target rank.

torchmetrics' retrieval metrics (``RetrievalHitRate``, ``RetrievalNormalizedDCG``, ``RetrievalMRR``)
take every item's score for every user; over an item table of millions of rows, sharded across
processes, that list never exists. With one relevant item per user (leave-one-out) each metric
depends only on the target's rank, the number of items ranked above it, which a sharded ranking
counts exactly. The sums add across batches and ranks, so the result is exact over every user.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric


class RankingMetrics(Metric):
    """Hit rate and NDCG at each cut-off of ``ks``, and MRR, of 0-based target ranks (0: the target is first).

    For a user whose target has rank ``r``: ``HR@K = 1 if r < K``, ``NDCG@K = 1 / log2(r + 2) if r < K``
    (else 0), ``MRR = 1 / (r + 1)``; each is averaged over users. ``update(ranks)`` takes ``[B]`` ranks;
    ``compute()`` returns ``{"hr@K": ..., "ndcg@K": ..., "mrr": ...}`` (float64 sums, added across
    processes before the division). Without any update the values are NaN.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, ks: Sequence[int] = (10, 100)) -> None:
        super().__init__()
        cutoffs = list(ks)
        if not cutoffs or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in cutoffs) or len(set(cutoffs)) != len(cutoffs):
            raise ValueError(f"ks={ks!r} must be a non-empty list of distinct integers >= 1 (the cut-offs K of HR@K and NDCG@K).")
        self.ks = tuple(sorted(cutoffs))
        self.add_state("hits", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("ndcg", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("reciprocal_ranks", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("users", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, ranks: torch.Tensor) -> None:
        if ranks.dim() != 1:
            raise ValueError(f"ranks must be [B] (one target rank per user), got shape {tuple(ranks.shape)}.")
        if ranks.is_floating_point() or ranks.is_complex():
            raise ValueError(f"ranks must be integers (how many items score above the target), got dtype {ranks.dtype}.")
        if ranks.numel() and int(ranks.min()) < 0:
            raise ValueError(f"ranks must be >= 0 (0: the target is first), got {int(ranks.min())}.")
        rank = ranks.to(torch.float64)
        cutoffs = torch.tensor(self.ks, dtype=torch.float64, device=rank.device)
        inside = rank[None, :] < cutoffs[:, None]  # [K, B]
        self.hits += inside.sum(dim=1).to(torch.float64)
        self.ndcg += (inside * (1.0 / torch.log2(rank + 2.0))[None, :]).sum(dim=1)
        self.reciprocal_ranks += (1.0 / (rank + 1.0)).sum()
        self.users += rank.numel()

    def compute(self) -> dict[str, torch.Tensor]:
        users = self.users
        values = {f"hr@{k}": self.hits[i] / users for i, k in enumerate(self.ks)}
        values.update({f"ndcg@{k}": self.ndcg[i] / users for i, k in enumerate(self.ks)})
        values["mrr"] = self.reciprocal_ranks / users
        return values
