"""The index-dedup option (TorchRec's use_index_dedup on the EmbeddingCollection sharder): config, sharders, our CPU kernel for FBGEMM's
jagged_unique_indices."""

from __future__ import annotations

import pytest
import torch

from lightning_recsys import QCommsConfig
from lightning_recsys.parallel.sharding import check_index_dedup_runs, install_cpu_jagged_unique_indices, make_sharders
from lightning_recsys.parallel.sharding.index_dedup import jagged_unique_indices_cpu
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


def _two_tables() -> tuple[torch.Tensor, ...]:
    """Table A (10 rows) read by features f0 and f1, table B (5 rows) by f2; batch 2, bags feature-major."""
    hash_size_cumsum = torch.tensor([0, 0, 10, 15])  # as ShardedEmbeddingCollection._create_hash_size_info builds it
    hash_size_offsets = torch.tensor([0, 2, 2, 3])
    offsets = torch.tensor([0, 3, 4, 6, 8, 9, 11])
    indices = torch.tensor([1, 1, 7, 3, 7, 2, 9, 1, 4, 4, 0])
    return hash_size_cumsum, hash_size_offsets, offsets, indices


def test_the_cpu_kernel_keeps_the_cuda_ops_output_contract() -> None:
    install_cpu_jagged_unique_indices()
    cumsum, groups, offsets, indices = _two_tables()
    lengths, new_offsets, unique, reverse = torch.ops.fbgemm.jagged_unique_indices(cumsum, groups, offsets, indices)
    # f0 and f1 share table A: one sorted id range {1, 2, 3, 7, 9}; then B's {0, 4}.
    assert unique.tolist() == [1, 2, 3, 7, 9, 0, 4]
    assert reverse.dtype == torch.int64 and torch.equal(unique[reverse], indices)
    # A's 5 unique ids spread over its 4 bags (first bag one more), B's 2 over its 2.
    assert lengths.tolist() == [2, 1, 1, 1, 1, 1]
    assert new_offsets.tolist() == [0, 2, 3, 4, 5, 6, 7]
    assert unique.dtype == indices.dtype and lengths.dtype == offsets.dtype


def test_the_cpu_kernel_handles_an_empty_batch_and_rejects_mixed_dtypes() -> None:
    install_cpu_jagged_unique_indices()
    cumsum, groups = torch.tensor([0, 10]), torch.tensor([0, 1])
    lengths, offsets, unique, reverse = torch.ops.fbgemm.jagged_unique_indices(cumsum, groups, torch.zeros(3, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert lengths.tolist() == [0, 0] and offsets.tolist() == [0, 0, 0] and unique.numel() == 0 and reverse.numel() == 0
    with pytest.raises(RuntimeError, match="hash_size_cumsum has dtype"):
        jagged_unique_indices_cpu(cumsum.int(), groups, torch.tensor([0, 1]), torch.tensor([3]))


def test_the_cpu_kernel_is_installed_once_and_only_where_fbgemm_has_none() -> None:
    install_cpu_jagged_unique_indices()
    assert install_cpu_jagged_unique_indices() is False  # a CPU kernel exists now: nothing to add
    check_index_dedup_runs("cpu")  # no error on CPU any more


def test_a_device_without_fbgemms_kernel_fails_clearly() -> None:
    with pytest.raises(ValueError, match=r"index_dedup=True.*jagged_unique_indices.*'mtia'.*index_dedup=False"):
        check_index_dedup_runs("mtia")
