"""Quantized embedding communication (QComms): precision config, the codecs each collective gets, and why.

TorchRec quantizes the payload of its embedding collectives through ``QuantizedCommCodec``
objects registered per collective in a sharder's ``qcomm_codecs_registry``. Its own registry
(``torchrec.distributed.fbgemm_qcomm_codec.get_qcomm_codecs_registry``) replaces BF16 with FP16
whenever the device is CPU, and FBGEMM's fp8 kernel has no CPU implementation
(``torch.ops.fbgemm.FloatToFP8RowwiseQuantized`` raises "fp8 is not supported by CPU" in
fbgemm_gpu 1.8), so the codecs are ours (``parallel/comms/codecs.py``), written with plain torch ops so
they run the same on CPU and CUDA:

* ``fp32``: no codec work at all; the tensor is sent as it is (NaN and Inf included).
* ``fp16``/``bf16``: a cast. Non-finite values are clamped: NaN -> 0, +-Inf and out-of-range
  values -> the format's largest finite magnitude.
* ``fp8`` (e4m3 or e5m2) and ``int8``: block-scaled. Every ``block_size`` consecutive values (one
  embedding row when all shards have the same width) share an fp32 scale ``amax / format_max``;
  the payload travels as ``uint8`` bytes ``[block bytes | 4 scale bytes]`` per block, which gloo and
  nccl both carry. NaN -> 0; +-Inf saturate to the block's largest finite magnitude.

On CUDA (``QCommsConfig.kernels="auto"``), fp8 and int8 use FBGEMM's fused rowwise kernels
instead where they apply: fp8 rows of one block (TorchRec's ``fp8_quantize_dim``), int8 rows of 32.

The block size is the gcd of the plan's shard widths, so it is known only with the plan. A byte
format sends ``1 + 4 / block`` bytes per value; where that is not fewer than bf16's 2 (a block of 4
or fewer values), it runs as bf16 instead. TorchRec's fused embedding kernels need shard widths that
are multiples of 4 (``_assert_local_cols_divisible_by_4`` in
torchrec/distributed/batched_embedding_kernel.py), so blocks have at least 4 values and a byte
format never sends more than fp32; at exactly 4 it would send as many bytes as bf16 at less precision.
A reduce-scatter sums its payloads on the wire and TorchRec sizes its buffers by the input shape, so
it can only use the casts: a byte format requested there runs as ``bf16`` too. ``EffectiveQComms``
says what really runs and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union, get_args

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torchrec.distributed.types import CommOp, QuantizedCommCodecs, ShardingPlan

from lightning_recsys.parallel.comms.codecs import (
    BYTE_DTYPES,
    CAST_DTYPES,
    BlockScaledCodec,
    CastCodec,
    PassThroughCodec,
    fbgemm_codec,
    fbgemm_unsupported,
    wire_bytes_per_value,
)

__all__ = [
    "BlockScaledCodec",
    "CastCodec",
    "EffectiveQComms",
    "PassThroughCodec",
    "QCommsCodecs",
    "QCommsConfig",
    "block_size_for_plan",
    "dense_grads_hook",
    "make_codec",
    "resolve_qcomms",
    "wire_bytes_per_value",
]

Precision = Literal["fp32", "bf16", "fp16", "fp8", "int8"]
Fp8Format = Literal["e4m3", "e5m2"]
Collective = Literal["pooled_all_to_all", "sequence_all_to_all", "reduce_scatter"]
DenseGradPrecision = Literal["fp32", "bf16", "fp16"]
Kernels = Literal["auto", "torch", "fbgemm"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
COLLECTIVES: tuple[str, ...] = get_args(Collective)
_COMM_OPS: dict[str, CommOp] = {
    "pooled_all_to_all": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "sequence_all_to_all": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "reduce_scatter": CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
}
_BYTE_FORMATS = ("fp8", "int8")
_FP8_FORMATS = ("e4m3", "e5m2")


@dataclass(frozen=True, kw_only=True)
class QCommsConfig:
    """Precision of the embedding collectives (and optionally of the dense gradient all-reduce).

    Args:
        forward: precision of the forward payloads (pooled embeddings): fp32, bf16, fp16, fp8, int8.
        backward: precision of the backward payloads (embedding gradients).
        collectives: the collectives it applies to: ``pooled_all_to_all`` (table/column-wise),
            ``sequence_all_to_all`` (EmbeddingCollection) and ``reduce_scatter`` (row-wise).
        fp8_forward_format / fp8_backward_format: the float8 layout when a direction is fp8
            (default e4m3 forward for precision, e5m2 backward for range).
        dense_grads: precision of DDP's dense-gradient all-reduce (fp32, bf16 or fp16; a DDP comm hook).
        kernels: what runs the fp8/int8 codecs: ``"auto"`` (FBGEMM's fused rowwise kernels on CUDA where
            they apply, the torch codecs elsewhere), ``"torch"`` (always the torch codecs) or
            ``"fbgemm"`` (FBGEMM's kernels or an error that says why not).
        index_dedup: send each rank's sequence ids once per table through the sequence all-to-all
            (TorchRec's ``EmbeddingCollectionSharder(use_index_dedup=True)``), in 1D and 2D. Off by
            default. It runs FBGEMM's ``jagged_unique_indices``: FBGEMM's kernel on CUDA, ours on CPU
            (``parallel.sharding.index_dedup``; fbgemm-gpu-cpu 1.8.0 has none); elsewhere an error.
    """

    forward: Precision = "fp32"
    backward: Precision = "fp32"
    collectives: tuple[Collective, ...] = COLLECTIVES  # type: ignore[assignment]
    fp8_forward_format: Fp8Format = "e4m3"
    fp8_backward_format: Fp8Format = "e5m2"
    dense_grads: DenseGradPrecision = "fp32"
    kernels: Kernels = "auto"
    index_dedup: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.index_dedup, bool):
            raise ValueError(f"QCommsConfig(index_dedup={self.index_dedup!r}) must be True or False.")
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value not in PRECISIONS:
                raise ValueError(f"QCommsConfig({name}={value!r}) is not one of {list(PRECISIONS)}.")
        object.__setattr__(self, "collectives", tuple(self.collectives))
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown or not self.collectives:
            raise ValueError(
                f"QCommsConfig(collectives={list(self.collectives)!r}) must be a non-empty subset of {list(COLLECTIVES)}."
            )
        for name in ("fp8_forward_format", "fp8_backward_format"):
            value = getattr(self, name)
            if value not in _FP8_FORMATS:
                raise ValueError(f"QCommsConfig({name}={value!r}) is not one of {list(_FP8_FORMATS)}.")
        if self.dense_grads not in get_args(DenseGradPrecision):
            raise ValueError(f"QCommsConfig(dense_grads={self.dense_grads!r}) is not one of {list(get_args(DenseGradPrecision))}.")
        if self.kernels not in get_args(Kernels):
            raise ValueError(f"QCommsConfig(kernels={self.kernels!r}) is not one of {list(get_args(Kernels))}.")

    @classmethod
    def preset(cls, name: str) -> QCommsConfig:
        """``fp32`` (off), ``bf16``, ``fp16``, ``fp8`` (e4m3 forward, e5m2 backward), ``int8`` (int8 forward, bf16 backward)."""
        presets = {
            "fp32": cls(),
            "bf16": cls(forward="bf16", backward="bf16"),
            "fp16": cls(forward="fp16", backward="fp16"),
            "fp8": cls(forward="fp8", backward="fp8"),
            "int8": cls(forward="int8", backward="bf16"),
        }
        if name not in presets:
            raise ValueError(f"qcomms={name!r} is not a preset; choose one of {list(presets)} or pass a QCommsConfig.")
        return presets[name]

    @classmethod
    def parse(cls, value: Union[str, QCommsConfig, None]) -> QCommsConfig:
        if value is None:
            return cls()
        if isinstance(value, QCommsConfig):
            return value
        if isinstance(value, str):
            return cls.preset(value)
        raise TypeError(f"qcomms={value!r} must be a preset name such as 'fp8', a QCommsConfig, or None.")


@dataclass(frozen=True)
class EffectiveQComms:
    """What each collective really uses (``"fp8_e4m3"``, ``"bf16"``, ...), and why where it differs.

    ``block_size`` (the scale block of fp8/int8) and ``fbgemm`` (the ``(collective, direction)``
    pairs FBGEMM's kernels carry) are set once the codecs are built from the sharding plan.
    """

    precisions: dict[str, tuple[str, str]]
    dense_grads: str
    fallbacks: tuple[str, ...] = ()
    kernels: str = "auto"
    block_size: Optional[int] = None
    fbgemm: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        lines = [
            f"{c}: forward {self._name(c, 'forward', f)}, backward {self._name(c, 'backward', b)}"
            for c, (f, b) in self.precisions.items()
        ]
        lines.append(f"dense gradient all-reduce: {self.dense_grads}")
        if self.block_size is not None and any(p in BYTE_DTYPES for pair in self.precisions.values() for p in pair):
            lines.append(f"fp8/int8 scale blocks: {self.block_size} values (the gcd of the plan's shard widths)")
        return "\n".join(lines)

    def wire_bytes(self, collective: str) -> tuple[float, float]:
        """Bytes on the wire per value (forward, backward) of ``collective``, scales included."""
        forward, backward = self.precisions[collective]
        return (
            wire_bytes_per_value(forward, self.block_size, fbgemm=(collective, "forward") in self.fbgemm),
            wire_bytes_per_value(backward, self.block_size, fbgemm=(collective, "backward") in self.fbgemm),
        )

    def _name(self, collective: str, direction: str, precision: str) -> str:
        return f"{precision} (FBGEMM)" if (collective, direction) in self.fbgemm else precision

    @property
    def is_off(self) -> bool:
        return self.dense_grads == "fp32" and all(p == ("fp32", "fp32") for p in self.precisions.values())


def resolve_qcomms(config: QCommsConfig) -> EffectiveQComms:
    """Per collective, the precision each direction really gets; byte formats cannot be reduce-scattered."""
    precisions: dict[str, tuple[str, str]] = {}
    fallbacks: list[str] = []
    for collective in COLLECTIVES:
        if collective not in config.collectives:
            precisions[collective] = ("fp32", "fp32")
            continue
        resolved = []
        for direction, precision, fp8_format in (
            ("forward", config.forward, config.fp8_forward_format),
            ("backward", config.backward, config.fp8_backward_format),
        ):
            if collective == "reduce_scatter" and precision in _BYTE_FORMATS:
                fallbacks.append(
                    f"reduce_scatter {direction}: {precision} cannot be summed on the wire, using bf16 instead"
                )
                precision = "bf16"
            resolved.append(f"fp8_{fp8_format}" if precision == "fp8" else precision)
        precisions[collective] = (resolved[0], resolved[1])
    return EffectiveQComms(
        precisions=precisions, dense_grads=config.dense_grads, fallbacks=tuple(fallbacks), kernels=config.kernels
    )


# ----------------------------------------------------------------------------------- codecs
Codec = Union[PassThroughCodec, CastCodec, BlockScaledCodec]


def make_codec(precision: str, block_size: Optional[int] = None, *, fbgemm: bool = False) -> Any:
    """The codec for an effective precision such as ``"bf16"`` or ``"fp8_e4m3"`` (FBGEMM's with ``fbgemm``)."""
    if precision == "fp32":
        return PassThroughCodec()
    if precision in CAST_DTYPES:
        return CastCodec(precision)
    if fbgemm:
        if block_size is None:
            raise ValueError(f"FBGEMM's {precision} codec needs the block size, known once the sharding plan is")
        return fbgemm_codec(precision, block_size)
    return BlockScaledCodec(precision, block_size)


@dataclass
class QCommsCodecs:
    """The codecs registry handed to TorchRec's sharders, and what each collective really uses.

    ``build(effective)`` makes the codecs the planner reads (only their wire dtypes count there);
    their byte codecs have no block size yet and refuse to encode. ``build(effective, plan)`` makes
    the final ones: the block size is the gcd of the plan's shard widths, and a byte format that
    would not send fewer bytes than bf16 at that block size runs as bf16 (``effective`` says so).
    """

    effective: EffectiveQComms
    registry: Optional[dict[str, QuantizedCommCodecs]]
    block_size: Optional[int] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    requested: Optional[EffectiveQComms] = None  # what ``effective`` was made from, before the plan

    @classmethod
    def build(
        cls, effective: EffectiveQComms, plan: Optional[ShardingPlan] = None, *, device: Union[str, torch.device, None] = None
    ) -> QCommsCodecs:
        device = torch.device(device if device is not None else "cpu")
        requested = effective
        block = None
        if plan is not None:
            block = block_size_for_plan(plan)
            effective = _final_effective(effective, block, device)
        elif effective.kernels == "fbgemm":  # refuse now what no plan can make possible
            for collective, pair in effective.precisions.items():
                for direction, precision in zip(("forward", "backward"), pair):
                    why_not = fbgemm_unsupported(precision, None, device) if precision in BYTE_DTYPES else None
                    if why_not is not None:
                        raise _fbgemm_refusal(f"{collective} {direction}", precision, device, why_not)
        fbgemm = set(effective.fbgemm)
        registry: dict[str, QuantizedCommCodecs] = {}
        for collective, (forward, backward) in effective.precisions.items():
            if (forward, backward) != ("fp32", "fp32"):
                registry[_COMM_OPS[collective].name] = QuantizedCommCodecs(
                    forward=make_codec(forward, block, fbgemm=(collective, "forward") in fbgemm),
                    backward=make_codec(backward, block, fbgemm=(collective, "backward") in fbgemm),
                )
        return cls(effective=effective, registry=registry or None, block_size=block, device=device, requested=requested)


def block_size_for_plan(plan: ShardingPlan) -> Optional[int]:
    """The gcd of every shard's width in ``plan``; None when no table is sharded (all data-parallel)."""
    widths: list[int] = []
    for module_plan in plan.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            spec = getattr(sharding, "sharding_spec", None)
            for shard in getattr(spec, "shards", None) or []:
                widths.append(int(shard.shard_sizes[-1]))
    return math.gcd(*widths) if widths else None


def _final_effective(effective: EffectiveQComms, block: Optional[int], device: torch.device) -> EffectiveQComms:
    precisions: dict[str, tuple[str, str]] = {}
    fallbacks = list(effective.fallbacks)
    fbgemm: list[tuple[str, str]] = []
    for collective, pair in effective.precisions.items():
        resolved = []
        for direction, precision in zip(("forward", "backward"), pair):
            precision, use_fbgemm, notes = _choose_codec(collective, direction, precision, block, device, effective.kernels)
            resolved.append(precision)
            fallbacks.extend(notes)
            if use_fbgemm:
                fbgemm.append((collective, direction))
        precisions[collective] = (resolved[0], resolved[1])
    return replace(effective, precisions=precisions, fallbacks=tuple(fallbacks), block_size=block, fbgemm=tuple(fbgemm))


def _choose_codec(
    collective: str, direction: str, precision: str, block: Optional[int], device: torch.device, kernels: str
) -> tuple[str, bool, list[str]]:
    """(precision, whether FBGEMM's kernel carries it, notes) for one direction, once the block size is known."""
    if precision not in BYTE_DTYPES or block is None:
        return precision, False, []
    label, notes = f"{collective} {direction}", []
    bf16 = wire_bytes_per_value("bf16")
    if kernels == "fbgemm" or (kernels == "auto" and device.type == "cuda"):
        why_not = fbgemm_unsupported(precision, block, device)
        if why_not is not None and kernels == "fbgemm":
            raise _fbgemm_refusal(label, precision, device, why_not)
        if why_not is None:
            fbgemm_bytes = wire_bytes_per_value(precision, block, fbgemm=True)
            if fbgemm_bytes < bf16:
                return precision, True, []
            why_not = (
                f"FBGEMM's {precision} rows of {block} values carry 8 bytes of scale and padding, {fbgemm_bytes:.2f} "
                f"bytes per value, not fewer than bf16's {bf16:g}"
            )
            if kernels == "fbgemm":
                return "bf16", False, [f"{label}: {why_not}; using bf16 instead"]
        notes.append(f"{label}: {why_not}; using the torch {precision} codec")
    own = wire_bytes_per_value(precision, block)
    if own < bf16:
        return precision, False, notes
    notes.append(
        f"{label}: {precision} with a 4-byte scale per block of {block} values (the gcd of the plan's shard "
        f"widths) sends {own:.2f} bytes per value, not fewer than bf16's {bf16:g}; using bf16 instead"
    )
    return "bf16", False, notes


def _fbgemm_refusal(label: str, precision: str, device: torch.device, why_not: str) -> ValueError:
    return ValueError(
        f"QCommsConfig(kernels='fbgemm'): {label} {precision} on {device.type}: {why_not}. Use kernels='auto' "
        "(FBGEMM's kernels where they apply, the torch codecs elsewhere) or kernels='torch'."
    )


# ----------------------------------------------------------------------------------- dense grads
def dense_grads_hook(precision: str) -> Any:
    """The DDP comm hook that all-reduces dense gradients in ``precision`` (fp32: DDP's plain all-reduce)."""
    return {
        "fp32": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }[precision]

