"""DCN-v2 ranker on ``torchrec.models.dlrm.DLRM_DCN``."""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM_DCN

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.models.base import DenseOptimizerName, RankerModule
from lightning_recsys.models.dlrm import dlrm_arguments


class DCNRanker(RankerModule):
    """DLRM with a DCN-v2 low-rank cross network in place of the pairwise dot interactions.

    The dense MLP output and the pooled embeddings are concatenated (``(F + 1) * D`` wide), passed
    through ``dcn_num_layers`` cross layers ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``, and then
    through the over MLP. Same tables, batches and sharding as ``DLRMRanker``.

    Args:
        table_sizes, num_dense_features, embedding_dim, dense_arch_layer_sizes, over_arch_layer_sizes,
            feature_names, embedding_device: as in ``DLRMRanker`` (``dense_arch_layer_sizes`` must
            end in ``embedding_dim``: the dense output is one more ``D``-wide slot of the cross input).
        dcn_num_layers: number of cross layers (>= 1).
        dcn_low_rank_dim: rank of each cross layer's ``W_l V_l`` factorization (>= 1); the full-rank
            weight would be ``(F + 1) * D`` square.
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
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 16,
        dense_optimizer: DenseOptimizerName = "adagrad",
        dense_lr: float = 0.05,
    ) -> None:
        super().__init__(dense_optimizer=dense_optimizer, dense_lr=dense_lr)
        self.save_hyperparameters()
        # Checked here because TorchRec asserts on low_rank and silently accepts 0 (identity) layers.
        for arg, value in (("dcn_num_layers", dcn_num_layers), ("dcn_low_rank_dim", dcn_low_rank_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}={value!r} must be an integer >= 1.")
        self.dcn = DLRM_DCN(
            **dlrm_arguments(self.hparams), dcn_num_layers=dcn_num_layers, dcn_low_rank_dim=dcn_low_rank_dim
        )

    def forward(self, batch: RecBatch) -> torch.Tensor:
        return self.dcn(batch.dense, batch.sparse).squeeze(-1)
