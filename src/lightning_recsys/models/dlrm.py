"""DLRM ranker on ``torchrec.models.dlrm.DLRM``, and the validated parts every DLRM-family ranker shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM

from lightning_recsys.data.batch import RecBatch, sparse_feature_names
from lightning_recsys.models.base import DenseOptimizerName, RankerModule


@dataclass(frozen=True)
class DLRMParts:
    """The validated inputs of a ``torchrec.models.dlrm.DLRM``-family model (DLRM, DLRM_DCN)."""

    embedding_bag_collection: EmbeddingBagCollection
    dense_arch_layer_sizes: list[int]
    over_arch_layer_sizes: list[int]


_PART_ARGUMENTS = (
    "table_sizes",
    "num_dense_features",
    "embedding_dim",
    "dense_arch_layer_sizes",
    "over_arch_layer_sizes",
    "feature_names",
    "embedding_device",
)


def dlrm_arguments(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The validated keyword arguments of TorchRec's ``DLRM``/``DLRM_DCN``, from a ranker's hyperparameters."""
    parts = build_dlrm_parts(*(hparams[name] for name in _PART_ARGUMENTS))
    return {
        "embedding_bag_collection": parts.embedding_bag_collection,
        "dense_in_features": hparams["num_dense_features"],
        "dense_arch_layer_sizes": parts.dense_arch_layer_sizes,
        "over_arch_layer_sizes": parts.over_arch_layer_sizes,
    }


def build_dlrm_parts(
    table_sizes: list[int],
    num_dense_features: int,
    embedding_dim: int,
    dense_arch_layer_sizes: list[int] | None,
    over_arch_layer_sizes: list[int] | None,
    feature_names: list[str] | None,
    embedding_device: str | None,
) -> DLRMParts:
    """Check the arguments DLRM-family rankers share and build their one-table-per-feature EBC.

    ``None`` layer sizes default to ``[64, embedding_dim]`` (dense) and ``[64, 32, 1]`` (over). Raises
    ``ValueError`` naming the argument, its value and the rule. See ``DLRMRanker`` for the arguments.
    """
    dense_sizes = [64, embedding_dim] if dense_arch_layer_sizes is None else list(dense_arch_layer_sizes)
    over_sizes = [64, 32, 1] if over_arch_layer_sizes is None else list(over_arch_layer_sizes)
    names = sparse_feature_names(len(table_sizes)) if feature_names is None else list(feature_names)
    if not table_sizes:
        raise ValueError("table_sizes=[] gives the model no embedding table; pass one size per sparse feature.")
    if any(not isinstance(rows, int) or rows < 1 for rows in table_sizes):
        raise ValueError(f"table_sizes={list(table_sizes)} must all be integers >= 1 (rows per table).")
    if len(names) != len(table_sizes):
        raise ValueError(
            f"feature_names has {len(names)} entries but table_sizes has {len(table_sizes)}; pass one name per table."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"feature_names={names} has duplicates; each table serves its own feature.")
    if not isinstance(num_dense_features, int) or num_dense_features < 0:
        raise ValueError(f"num_dense_features={num_dense_features} must be an integer >= 0.")
    if not isinstance(embedding_dim, int) or embedding_dim < 1:
        raise ValueError(f"embedding_dim={embedding_dim} must be an integer >= 1.")
    for arg, sizes in (("dense_arch_layer_sizes", dense_sizes), ("over_arch_layer_sizes", over_sizes)):
        if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"{arg}={sizes} must be a non-empty list of integers >= 1 (or None for the default).")
    if dense_sizes[-1] != embedding_dim:
        raise ValueError(
            f"dense_arch_layer_sizes={dense_sizes} must end in embedding_dim={embedding_dim}: DLRM "
            "interacts the dense output with the embeddings by dot products."
        )
    if over_sizes[-1] != 1:
        raise ValueError(f"over_arch_layer_sizes={over_sizes} must end in 1 (one logit per example).")
    if len(over_sizes) < 2:  # TorchRec's OverArch asserts it ("OverArch must have multiple layers.")
        raise ValueError(
            f"over_arch_layer_sizes={over_sizes} must have at least two layers (TorchRec's OverArch), ending in 1: e.g. [16, 1]."
        )
    try:
        device = torch.device(embedding_device) if embedding_device else None
    except RuntimeError as err:  # torch's own message does not name our argument
        raise ValueError(
            f"embedding_device={embedding_device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'meta'."
        ) from err
    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=embedding_dim, num_embeddings=rows, feature_names=[name])
        for name, rows in zip(names, table_sizes)
    ]
    return DLRMParts(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=device),
        dense_arch_layer_sizes=dense_sizes,
        over_arch_layer_sizes=over_sizes,
    )


class DLRMRanker(RankerModule):
    """DLRM (dense MLP, pairwise dot interactions, over MLP) with one table per sparse feature.

    Args:
        table_sizes: rows of each table; table ``i`` serves feature ``feature_names[i]``.
        num_dense_features: width of ``batch.dense``.
        embedding_dim: the dimension of every table; must equal ``dense_arch_layer_sizes[-1]``.
        dense_arch_layer_sizes: the dense MLP.
        over_arch_layer_sizes: the top MLP; at least two layers, ending in 1.
        feature_names: sparse feature names, default ``sparse_0 .. sparse_{n-1}``.
        embedding_device: where the tables are built. ``"meta"`` allocates nothing: the sharding
            strategy materializes only this rank's shards (randomly initialized by TorchRec).
        dense_optimizer, dense_lr: see ``RankerModule``.
    """

    def __init__(
        self,
        table_sizes: list[int],
        num_dense_features: int = 13,
        embedding_dim: int = 16,
        dense_arch_layer_sizes: list[int] | None = None,
        over_arch_layer_sizes: list[int] | None = None,
        feature_names: list[str] | None = None,
        embedding_device: str | None = None,
        dense_optimizer: DenseOptimizerName = "adagrad",
        dense_lr: float = 0.05,
    ) -> None:
        super().__init__(dense_optimizer=dense_optimizer, dense_lr=dense_lr)
        self.save_hyperparameters()
        self.dlrm = DLRM(**dlrm_arguments(self.hparams))

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self.dlrm(batch.dense, batch.sparse).squeeze(-1)
