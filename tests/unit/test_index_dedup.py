"""The index-dedup option (TorchRec's use_index_dedup on the EmbeddingCollection sharder): config, sharders, the CPU error."""

from __future__ import annotations

import pytest
import torch

from lightning_recsys import QCommsConfig
from lightning_recsys.parallel.sharding import check_index_dedup_runs, make_sharders
from lightning_recsys.parallel.sharding.sharders import RecSysEmbeddingBagCollectionSharder, RecSysEmbeddingCollectionSharder


def test_the_option_is_validated_and_off_by_default() -> None:
    assert QCommsConfig().index_dedup is False
    assert QCommsConfig(index_dedup=True).index_dedup is True
    with pytest.raises(ValueError, match=r"index_dedup='yes'"):
        QCommsConfig(index_dedup="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("dedup", [False, True])
def test_only_the_sequence_sharder_dedups(dedup: bool) -> None:
    sharders = make_sharders({}, index_dedup=dedup)
    sequence = next(s for s in sharders if isinstance(s, RecSysEmbeddingCollectionSharder))
    assert sequence._use_index_dedup is dedup  # what TorchRec's shard() hands to ShardedEmbeddingCollection
    assert any(isinstance(s, RecSysEmbeddingBagCollectionSharder) for s in sharders)


def _fbgemm_dedup_runs_on_cpu() -> bool:
    import fbgemm_gpu  # noqa: F401

    one_table = torch.tensor([0, 10]), torch.tensor([0, 1])  # hash-size cumsum and offsets of one 10-row table
    try:
        torch.ops.fbgemm.jagged_unique_indices(*one_table, torch.tensor([0, 2, 3]), torch.tensor([1, 1, 2]))
    except NotImplementedError:
        return False
    return True


def test_the_option_fails_clearly_exactly_where_fbgemms_dedup_kernel_cannot_run() -> None:
    if _fbgemm_dedup_runs_on_cpu():
        check_index_dedup_runs("cpu")  # a build with the CPU kernel: no error
        return
    with pytest.raises(ValueError, match=r"index_dedup=True.*jagged_unique_indices.*'cpu'.*index_dedup=False"):
        check_index_dedup_runs("cpu")
