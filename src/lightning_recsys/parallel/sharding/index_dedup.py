"""TorchRec's index dedup on CPU: a CPU kernel for ``fbgemm::jagged_unique_indices`` where FBGEMM has none.

``EmbeddingCollectionSharder(use_index_dedup=True)`` makes ``ShardedEmbeddingCollection._dedup_indices``
(torchrec/distributed/embedding.py) call ``torch.ops.fbgemm.jagged_unique_indices`` on each rank's
features before the input distribution. fbgemm-gpu-cpu 1.8.0 declares the op's schema
(``jagged_tensor_ops_cpu.cpp``) but registers a kernel only for CUDA
(``fbgemm_gpu/src/jagged_tensor_ops/jagged_unique_indices.cu``), so on CPU the first forward fails.
The kernel below keeps the CUDA op's output contract, written with ``torch.unique``:

- inputs: ``hash_size_cumsum`` (T+1; the ids of feature t are offset by entry t, and the features of
  one table share one id range), ``hash_size_offsets`` (the features each group of features spans),
  ``offsets`` (T*B+1, feature-major bags) and ``indices`` (N);
- ``unique_indices``: the sorted unique offset ids, with each feature's offset taken off again, in
  the dtype of ``indices``;
- ``reverse_indices`` (int64, N): ``unique[reverse[i]]`` is the (offset) id at position i, which
  TorchRec's ``construct_jagged_tensors`` uses to expand the unique rows back (``index_select`` or
  ``gather``: differentiable, so the backward adds up the gradients of repeated ids);
- ``lengths`` (T*B, dtype of ``offsets``): a group's unique ids spread evenly over its bags, the
  first ones taking one more; ``offsets`` is their complete cumulative sum.

The op reads integer ids only, so it has no backward of its own.
"""

from __future__ import annotations

import torch

_OP = "fbgemm::jagged_unique_indices"
_library: torch.library.Library | None = None  # kept alive: the registration lasts as long as this object


def jagged_unique_indices_cpu(
    hash_size_cumsum: torch.Tensor, hash_size_offsets: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fbgemm::jagged_unique_indices`` on CPU tensors: (lengths, offsets, unique_indices, reverse_indices)."""
    if hash_size_cumsum.dtype != indices.dtype:
        raise RuntimeError(
            f"jagged_unique_indices: hash_size_cumsum has dtype {hash_size_cumsum.dtype} but indices have "
            f"{indices.dtype}; they must be equal (as FBGEMM's CUDA kernel checks)."
        )
    if hash_size_cumsum.numel() < 1:
        raise RuntimeError("jagged_unique_indices: hash_size_cumsum must have at least one entry.")
    num_features = hash_size_cumsum.numel() - 1
    total_bags = offsets.numel() - 1
    batch = total_bags // num_features if num_features > 0 else 0
    bag_lengths = offsets[1:] - offsets[:-1]
    feature_of_bag = torch.arange(total_bags, dtype=torch.int64) // max(batch, 1)
    feature_of_id = torch.repeat_interleave(feature_of_bag, bag_lengths.to(torch.int64), output_size=indices.numel())
    linear = indices + hash_size_cumsum[feature_of_id]
    unique_linear, reverse = torch.unique(linear, sorted=True, return_inverse=True)
    owner = torch.searchsorted(hash_size_cumsum, unique_linear, right=True) - 1
    unique_indices = (unique_linear - hash_size_cumsum[owner]).to(indices.dtype)

    lengths = torch.zeros(total_bags, dtype=offsets.dtype)
    cumsum, groups = hash_size_cumsum.tolist(), hash_size_offsets.tolist()
    for begin, end in zip(groups[:-1], groups[1:]):
        bags = (end - begin) * batch
        if bags == 0 or cumsum[begin] == cumsum[end]:
            continue
        bounds = torch.tensor([cumsum[begin], cumsum[end]], dtype=unique_linear.dtype)
        low, high = torch.searchsorted(unique_linear, bounds).tolist()
        share, extra = divmod(high - low, bags)
        group_lengths = torch.full((bags,), share, dtype=offsets.dtype)
        group_lengths[:extra] += 1
        lengths[begin * batch : end * batch] = group_lengths
    complete_offsets = torch.cat([torch.zeros(1, dtype=offsets.dtype), torch.cumsum(lengths, 0).to(offsets.dtype)])
    return lengths, complete_offsets, unique_indices, reverse.to(torch.int64)


def _has_kernel(dispatch_key: str) -> bool:
    import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops)

    # torch has no public "is this op implemented for this device" query; the dispatcher's table says it.
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(_OP, dispatch_key))


def install_cpu_jagged_unique_indices() -> bool:
    """Register :func:`jagged_unique_indices_cpu` for the CPU dispatch key unless a CPU kernel exists.

    Returns whether it registered one. Idempotent: a second call finds the first one's kernel.
    """
    global _library
    if _has_kernel("CPU"):
        return False
    # Workaround: fbgemm-gpu-cpu 1.8.0 has no CPU kernel for jagged_unique_indices (only CUDA, jagged_unique_indices.cu).
    _library = torch.library.Library("fbgemm", "IMPL")
    _library.impl("jagged_unique_indices", jagged_unique_indices_cpu, "CPU")
    return True


def check_index_dedup_runs(compute_device_type: str) -> None:
    """Make TorchRec's index dedup run on ``compute_device_type``, or raise if it cannot.

    On CPU this installs :func:`jagged_unique_indices_cpu` where FBGEMM has no CPU kernel; elsewhere
    it raises unless FBGEMM has a kernel for ``jagged_unique_indices`` there (the op
    ``ShardedEmbeddingCollection._dedup_indices`` in torchrec/distributed/embedding.py runs).
    """
    if compute_device_type == "cpu":
        install_cpu_jagged_unique_indices()
        return
    key = {"cuda": "CUDA"}.get(compute_device_type, compute_device_type.upper())
    if not _has_kernel(key):
        raise ValueError(
            f"QCommsConfig(index_dedup=True) needs FBGEMM's jagged_unique_indices on {compute_device_type!r}, which this "
            "fbgemm_gpu build does not have. Set index_dedup=False, or train on CPU or on CUDA with the CUDA build of "
            "fbgemm-gpu."
        )
