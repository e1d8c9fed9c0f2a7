"""Quantized embedding communication (QComms): precision config, codecs, and what each backend gets.

TorchRec quantizes the payload of its embedding collectives through ``QuantizedCommCodec``
objects registered per collective in a sharder's ``qcomm_codecs_registry``. Its FBGEMM codecs do
not run FP8 on CPU and silently swap BF16 for FP16 on gloo (see DESIGN.md), so this module
provides its own codecs, written with plain torch ops so they run the same on CPU and CUDA:

* ``fp32``/``fp16``/``bf16``: a cast. Non-finite values are clamped: NaN -> 0, +-Inf and
  out-of-range values -> the format's largest finite magnitude.
* ``fp8`` (e4m3 or e5m2) and ``int8``: block-scaled. Every ``block_size`` consecutive values (one
  embedding row when all shards have the same width) share an fp32 scale ``amax / format_max``;
  the payload travels as ``uint8`` bytes ``[block bytes | 4 scale bytes]`` per block, which gloo and
  nccl both carry. NaN -> 0; +-Inf saturate to the block's largest finite magnitude.

A reduce-scatter sums its payloads on the wire and TorchRec sizes its buffers by the input shape,
so it can only use the casts: a byte format requested there falls back to ``bf16`` with one
warning, and ``effective`` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torchrec.distributed.types import CommOp, QuantizedCommCodecs, ShardingPlan

Precision = Literal["fp32", "bf16", "fp16", "fp8", "int8"]
Fp8Format = Literal["e4m3", "e5m2"]
Collective = Literal["pooled_all_to_all", "sequence_all_to_all", "reduce_scatter"]
DenseGradPrecision = Literal["fp32", "bf16", "fp16"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
COLLECTIVES: tuple[str, ...] = get_args(Collective)
_COMM_OPS: dict[str, CommOp] = {
    "pooled_all_to_all": CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
    "sequence_all_to_all": CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    "reduce_scatter": CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
}
_BYTE_FORMATS = ("fp8", "int8")
_CAST_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_SCALE_BYTES = 4


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
    """

    forward: Precision = "fp32"
    backward: Precision = "fp32"
    collectives: tuple[Collective, ...] = COLLECTIVES  # type: ignore[assignment]
    fp8_forward_format: Fp8Format = "e4m3"
    fp8_backward_format: Fp8Format = "e5m2"
    dense_grads: DenseGradPrecision = "fp32"

    def __post_init__(self) -> None:
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
            if value not in _FP8_DTYPES:
                raise ValueError(f"QCommsConfig({name}={value!r}) is not one of {list(_FP8_DTYPES)}.")
        if self.dense_grads not in get_args(DenseGradPrecision):
            raise ValueError(f"QCommsConfig(dense_grads={self.dense_grads!r}) is not one of {list(get_args(DenseGradPrecision))}.")

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
    """What each collective really uses (``"fp8_e4m3"``, ``"bf16"``, ...), and why where it differs."""

    precisions: dict[str, tuple[str, str]]
    dense_grads: str
    fallbacks: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [f"{c}: forward {f}, backward {b}" for c, (f, b) in self.precisions.items()]
        lines.append(f"dense gradient all-reduce: {self.dense_grads}")
        return "\n".join(lines)

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
    return EffectiveQComms(precisions=precisions, dense_grads=config.dense_grads, fallbacks=tuple(fallbacks))


# ----------------------------------------------------------------------------------- codecs
class CastCodec:
    """TorchRec QuantizedCommCodec that casts to fp32/fp16/bf16 (clamping non-finite values)."""

    def __init__(self, precision: str) -> None:
        self.precision = precision
        self._dtype = _CAST_DTYPES[precision]
        self._max = torch.finfo(self._dtype).max

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        clamped = torch.nan_to_num(input_tensor, nan=0.0, posinf=self._max, neginf=-self._max)
        return clamped.clamp(-self._max, self._max).to(self._dtype)

    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return input_grad.to(torch.float32)

    def calc_quantized_size(self, input_len: int, ctx: Optional[Any] = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]:
        return (input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]), 0


@dataclass
class BlockSize:
    """The block (scale group) size shared by the byte codecs; fixed once the sharding plan is known."""

    value: Optional[int] = None


@dataclass
class BlockScaledCodec:
    """TorchRec QuantizedCommCodec for fp8 (e4m3/e5m2) or int8 with one fp32 scale per block, sent as bytes."""

    precision: str  # "fp8_e4m3", "fp8_e5m2" or "int8"
    block: BlockSize = field(default_factory=BlockSize)

    def __post_init__(self) -> None:
        if self.precision == "int8":
            self._dtype, self._max = torch.int8, 127.0
        else:
            self._dtype = _FP8_DTYPES[self.precision.removeprefix("fp8_")]
            self._max = float(torch.finfo(self._dtype).max)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def block_size(self) -> int:
        if self.block.value is None:
            raise RuntimeError(f"the {self.precision} codec's block size is set from the sharding plan before use")
        return self.block.value

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        """Flat uint8: whole blocks, then (outside TorchRec's aligned payloads) one shorter tail block."""
        flat = input_tensor.reshape(-1).to(torch.float32)
        whole = flat.numel() // self.block_size * self.block_size
        parts = [self._encode_blocks(flat[:whole].view(-1, self.block_size))]
        if whole < flat.numel():
            parts.append(self._encode_blocks(flat[whole:].view(1, -1)))
        return torch.cat([p.reshape(-1) for p in parts])

    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        size = self.block_size
        stride = size + _SCALE_BYTES
        whole = input_grad.numel() // stride * stride
        tail = input_grad.numel() - whole
        if 0 < tail <= _SCALE_BYTES:
            raise ValueError(f"{self.precision} qcomms: {input_grad.numel()} bytes is not a valid encoded payload.")
        parts = [self._decode_blocks(input_grad[:whole].view(-1, stride), size)]
        if tail:
            parts.append(self._decode_blocks(input_grad[whole:].view(1, -1), tail - _SCALE_BYTES))
        return torch.cat([p.reshape(-1) for p in parts])

    def calc_quantized_size(self, input_len: int, ctx: Optional[Any] = None) -> int:
        # TorchRec sizes each rank's chunk with this and decodes the chunks concatenated, so every
        # chunk must be whole blocks; a shorter tail block is only decodable at the very end.
        size = self.block_size
        if input_len % size:
            raise ValueError(
                f"{self.precision} qcomms: a payload of {input_len} values is not a whole number of blocks of "
                f"{size} (the block size is the gcd of the sharded embedding widths)."
            )
        return input_len // size * (size + _SCALE_BYTES)

    def _encode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(blocks)
        amax = torch.where(finite, blocks.abs(), torch.zeros_like(blocks)).amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / self._max, torch.ones_like(amax))
        scaled = torch.nan_to_num(blocks / scale, nan=0.0, posinf=self._max, neginf=-self._max).clamp_(-self._max, self._max)
        if self._dtype is torch.int8:
            scaled = scaled.round_()
        return torch.cat([scaled.to(self._dtype).view(torch.uint8), scale.view(torch.uint8)], dim=1)

    def _decode_blocks(self, rows: torch.Tensor, size: int) -> torch.Tensor:
        payload = rows[:, :size].contiguous().view(self._dtype).to(torch.float32)
        scale = rows[:, size:].flatten().clone().view(torch.float32).unsqueeze(1)  # fresh storage: 4-byte aligned
        return payload * scale

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]:
        return (input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]), 0


Codec = Union[CastCodec, BlockScaledCodec]


def make_codec(precision: str, block: BlockSize) -> Codec:
    """The codec for an effective precision string such as ``"bf16"`` or ``"fp8_e4m3"``."""
    if precision in _CAST_DTYPES:
        return CastCodec(precision)
    return BlockScaledCodec(precision, block)


@dataclass
class QCommsCodecs:
    """The codecs registry handed to TorchRec's sharders, and the block size its byte codecs share."""

    effective: EffectiveQComms
    registry: Optional[dict[str, QuantizedCommCodecs]]
    block: BlockSize

    @classmethod
    def build(cls, effective: EffectiveQComms) -> QCommsCodecs:
        block = BlockSize()
        registry: dict[str, QuantizedCommCodecs] = {}
        for collective, (forward, backward) in effective.precisions.items():
            if (forward, backward) != ("fp32", "fp32"):
                registry[_COMM_OPS[collective].name] = QuantizedCommCodecs(
                    forward=make_codec(forward, block), backward=make_codec(backward, block)  # type: ignore[arg-type]
                )
        return cls(effective=effective, registry=registry or None, block=block)

    def fix_block_size(self, plan: ShardingPlan) -> None:
        """Use one block per embedding row: the gcd of every shard's width in ``plan``."""
        self.block.value = block_size_for_plan(plan)


def block_size_for_plan(plan: ShardingPlan) -> int:
    widths: list[int] = []
    for module_plan in plan.plan.values():
        for sharding in module_plan.values():  # type: ignore[union-attr]
            spec = getattr(sharding, "sharding_spec", None)
            for shard in getattr(spec, "shards", None) or []:
                widths.append(int(shard.shard_sizes[-1]))
    return math.gcd(*widths) if widths else 1


# ----------------------------------------------------------------------------------- dense grads
def dense_grads_hook(precision: str) -> Any:
    """The DDP comm hook that all-reduces dense gradients in ``precision`` (fp32: DDP's plain all-reduce)."""
    return {
        "fp32": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }[precision]

