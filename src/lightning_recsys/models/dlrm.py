"""DLRM ranker on ``torchrec.models.dlrm.DLRM``."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM

from lightning_recsys.data.batch import RecBatch, sparse_feature_names
from lightning_recsys.models.base import DenseOptimizerName, RankerModule


class DLRMRanker(RankerModule):
    """DLRM (dense MLP, pairwise dot interactions, over MLP) with one table per sparse feature.

    Args:
        table_sizes: rows of each table; table ``i`` serves feature ``feature_names[i]``.
        num_dense_features: width of ``batch.dense``.
        embedding_dim: the dimension of every table; must equal ``dense_arch_layer_sizes[-1]``.
        dense_arch_layer_sizes: the dense MLP.
        over_arch_layer_sizes: the top MLP; must end in 1.
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
        dense_sizes = list(dense_arch_layer_sizes or [64, embedding_dim])
        over_sizes = list(over_arch_layer_sizes or [64, 32, 1])
        names = list(feature_names or sparse_feature_names(len(table_sizes)))
        if not table_sizes:
            raise ValueError("table_sizes=[] gives the model no embedding table; pass one size per sparse feature.")
        if len(names) != len(table_sizes):
            raise ValueError(f"feature_names has {len(names)} entries but table_sizes has {len(table_sizes)}.")
        if dense_sizes[-1] != embedding_dim:
            raise ValueError(
                f"dense_arch_layer_sizes={dense_sizes} must end in embedding_dim={embedding_dim}: DLRM "
                "interacts the dense output with the embeddings by dot products."
            )
        if over_sizes[-1] != 1:
            raise ValueError(f"over_arch_layer_sizes={over_sizes} must end in 1 (one logit per example).")
        tables = [
            EmbeddingBagConfig(name=f"t_{name}", embedding_dim=embedding_dim, num_embeddings=rows, feature_names=[name])
            for name, rows in zip(names, table_sizes)
        ]
        device = torch.device(embedding_device) if embedding_device else None
        self.dlrm = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=device),
            dense_in_features=num_dense_features,
            dense_arch_layer_sizes=dense_sizes,
            over_arch_layer_sizes=over_sizes,
        )

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self.dlrm(batch.dense, batch.sparse).squeeze(-1)
