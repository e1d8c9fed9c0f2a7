"""DCNRanker (DCN-v2 on TorchRec's DLRM_DCN) and the bring-your-own-ranker example, on one process."""

import math

import pytest
import torch
import torch.nn.functional as F
from docs_text import fenced_blocks
from lightning.pytorch import Trainer, seed_everything

from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DCNRanker, DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[50, 80, 120], num_dense_features=4, global_batch_size=64, seed=3)
SMALL = dict(table_sizes=CONFIG.table_sizes, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[16, 8])


def test_forward_gives_one_logit_per_example_through_the_cross_net():
    torch.manual_seed(0)
    model = DCNRanker(**SMALL, over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    batch = SyntheticClickLog(CONFIG).global_batch("train", 0)
    logits = model(batch)
    assert logits.shape == (batch.batch_size,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # dcn_num_layers low-rank layers over the (F + 1) * D concatenation of 3 tables and the dense output.
    crossnet = model.dcn.inter_arch.crossnet
    assert len(crossnet.W_kernels) == 2
    assert all(w.shape == ((3 + 1) * 8, 4) for w in crossnet.W_kernels)
    assert model.hparams.dcn_num_layers == 2 and model.hparams.dcn_low_rank_dim == 4


def test_sgd_steps_reduce_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    model = DCNRanker(**SMALL, dense_optimizer="sgd", dense_lr=0.5, dcn_num_layers=2, dcn_low_rank_dim=4)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    batch = SyntheticClickLog(CONFIG).global_batch("train", 0)
    losses = []
    for _ in range(30):
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Full-batch gradient descent with a small step goes downhill every step, not just on average.
    assert all(after < before for before, after in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.01, losses


def test_builds_tables_on_meta_and_dense_layers_on_cpu():
    model = DCNRanker(table_sizes=[10**7, 10**7], embedding_dim=16, embedding_device="meta")
    tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    assert tables and all(p.is_meta for p in tables)
    assert dense and not any(p.is_meta for p in dense)


# The DCN arguments, then a sample of the checks DCNRanker shares with DLRMRanker through dlrm_arguments.
_INVALID = [
    ({"dcn_num_layers": 0}, r"dcn_num_layers=0 must be an integer >= 1"),
    ({"dcn_num_layers": 1.5}, r"dcn_num_layers=1.5 must be an integer >= 1"),
    ({"dcn_num_layers": True}, r"dcn_num_layers=True must be an integer >= 1"),
    ({"dcn_low_rank_dim": 0}, r"dcn_low_rank_dim=0 must be an integer >= 1"),
    ({"table_sizes": []}, r"table_sizes=\[\] gives the model no embedding table"),
    ({"table_sizes": [5, 0]}, r"table_sizes=\[5, 0\] must all be integers >= 1"),
    ({"table_sizes": [5, 6], "feature_names": ["a"]}, r"feature_names has 1 entries but table_sizes has 2"),
    ({"table_sizes": [5, 6], "feature_names": ["a", "a"]}, r"feature_names=\['a', 'a'\] has duplicates"),
    ({"num_dense_features": -1}, r"num_dense_features=-1 must be an integer >= 0"),
    ({"embedding_dim": 0, "dense_arch_layer_sizes": [0]}, r"embedding_dim=0 must be an integer >= 1"),
    ({"embedding_dim": 8, "dense_arch_layer_sizes": [16, 4]}, r"dense_arch_layer_sizes=\[16, 4\] must end in embedding_dim=8"),
    ({"dense_arch_layer_sizes": []}, r"dense_arch_layer_sizes=\[\] must be a non-empty list of integers >= 1"),
    ({"over_arch_layer_sizes": [8, 2]}, r"over_arch_layer_sizes=\[8, 2\] must end in 1"),
    ({"over_arch_layer_sizes": [0, 1]}, r"over_arch_layer_sizes=\[0, 1\] must be a non-empty list of integers >= 1"),
    ({"embedding_device": "nowhere"}, r"embedding_device='nowhere' is not a torch device"),
    ({"dense_optimizer": "lbfgs"}, r"dense_optimizer='lbfgs' is not one of"),
    ({"dense_lr": 0.0}, r"dense_lr=0.0 must be > 0"),
]


@pytest.mark.parametrize(("kwargs", "message"), _INVALID)
def test_invalid_arguments_are_rejected_with_their_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DCNRanker(**{"table_sizes": [5], **kwargs})


@pytest.mark.parametrize(("kwargs", "message"), [row for row in _INVALID if not next(iter(row[0])).startswith("dcn_")])
def test_dlrm_shares_the_same_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DLRMRanker(**{"table_sizes": [5], **kwargs})


def test_bring_your_own_ranker_snippet_trains():
    # The "bring your own ranker" block of docs/models-and-metrics.md, run as it stands there.
    (code,) = [code for _, code in fenced_blocks("python") if "class ConcatMLPRanker(RankerModule):" in code]
    namespace: dict = {}
    exec(code, namespace)
    ConcatMLPRanker = namespace["ConcatMLPRanker"]

    seed_everything(0)
    config = SyntheticClickLogConfig(table_sizes=[100, 100], num_dense_features=4, global_batch_size=256, train_batches=20, val_batches=4)
    model, data = ConcatMLPRanker(config.table_sizes, config.num_dense_features), SyntheticClickLogDataModule.from_config(config)
    trainer = Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    trainer.fit(model, data)
    print({name: round(value.item(), 4) for name, value in trainer.callback_metrics.items()})
    metrics = trainer.callback_metrics
    assert trainer.global_step == 20
    assert math.isfinite(metrics["val/calibration"].item())
    assert metrics["val/ne"].item() < 0.95  # clearly better than always predicting the base CTR
    assert metrics["val/auc"].item() > 0.65
