"""The QComms codecs: TorchRec ``QuantizedCommCodec`` objects for each wire precision.

* ``PassThroughCodec`` (fp32): sends the tensor as it is; no value changes, NaN and Inf included.
* ``CastCodec`` (fp16, bf16): a cast. NaN -> 0; +-Inf and out-of-range values -> the format's
  largest finite magnitude.
* ``BlockScaledCodec`` (fp8 e4m3/e5m2, int8): every ``block_size`` consecutive values share an fp32
  scale ``amax / format_max``; the payload travels as ``uint8`` rows ``[block bytes | 4 scale
  bytes]``, which gloo and nccl both carry. NaN -> 0; +-Inf saturate to the block's largest finite
  magnitude. Written with plain torch ops, so it runs the same on CPU and CUDA.
* ``fbgemm_codec``: FBGEMM's fused rowwise kernels (``fbgemm_gpu.quantize_comm.QuantizedCommCodec``,
  what ``torchrec.distributed.fbgemm_qcomm_codec.get_qcomm_codecs`` builds), for CUDA.

Speed (one CPU thread; ``benchmarks/codec_speed.py`` measures it): the block-scaled codecs work on
chunks of about 256K values, so their temporaries stay in cache and are reused; the amax, the scale
and the cast each take one pass, the scaled values are written in place, and the payload and scale
bytes are written straight into their place in the output rows (views, no concatenation). Decoding
fp8 does not use torch's float8 -> float32 cast, which is scalar on CPU: an fp8 byte is the top of an
fp16 bit pattern (e5m2 exactly; e4m3 after moving its 7 low bits and multiplying by 2**8), so it
widens to int16, shifts, and goes through the vectorized fp16 -> fp32 cast. The results are bit for
bit those of the straightforward ``x / scale`` then ``.to(float8)`` and ``payload.float() * scale``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

SCALE_BYTES = 4
CAST_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BYTE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
# Values per chunk of the block-scaled codecs on CPU: 1 MiB of fp32 scratch, reused chunk after
# chunk (smaller chunks measured slower here: each torch op has a fixed cost of a few microseconds).
_CHUNK_VALUES = 1 << 18
# An e4m3 byte with its 7 low bits shifted to bits 13..7 of an int16 and bit 14 cleared is the
# fp16 of value / 2**8 (the exponent biases differ by 8); -16385 is 0xBFFF as an int16.
_E4M3_FP16_SHIFT, _E4M3_FP16_MASK, _E4M3_FP16_FACTOR = 7, -16385, 256.0
_TINY = torch.finfo(torch.float32).tiny  # a scale below this is subnormal: x / scale may overshoot


def wire_bytes_per_value(precision: str, block_size: Optional[int] = None, *, fbgemm: bool = False) -> float:
    """Bytes on the wire per embedding value at ``precision`` (``"fp8_e4m3"``, ``"bf16"``, ...).

    The byte formats add their per-block scale: 4 bytes per block here, 8 per row for FBGEMM
    (``FloatToFP8RowwiseQuantized``: the row padded to 4 bytes, then an fp32 scale and 4 bytes of
    padding; ``FloatToFused8BitRowwiseQuantized``: fp32 scale and bias per row of 32, the row its
    ``QuantizationContext`` fixes for int8). Without a block size, the byte formats count 1 byte.
    """
    if precision in CAST_DTYPES:
        return float(CAST_DTYPES[precision].itemsize)
    if precision not in BYTE_DTYPES:
        raise ValueError(f"unknown QComms precision {precision!r}")
    if fbgemm:
        row = 32 if precision == "int8" else block_size
        return 1.0 if row is None else ((row + 3) // 4 * 4 + 8) / row
    return 1.0 if block_size is None else 1.0 + SCALE_BYTES / block_size


class _Codec:
    """The parts of TorchRec's ``QuantizedCommCodec`` protocol every codec here shares."""

    precision: str

    def calc_quantized_size(self, input_len: int, ctx: Optional[Any] = None) -> int:
        return input_len

    def create_context(self) -> None:
        return None

    def padded_size(self, input_tensor: torch.Tensor, dim_per_rank: list[int], my_rank: int, qcomm_ctx: Any) -> tuple[int, int]:
        return (input_tensor.shape[0] if input_tensor.dim() == 1 else input_tensor.shape[1]), 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"


class PassThroughCodec(_Codec):
    """fp32: the tensor goes on the wire as it is (the direction of a pair that is not quantized)."""

    precision = "fp32"

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.float32

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return input_tensor.to(torch.float32)  # the same tensor when it is fp32 already

    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return input_grad.to(torch.float32)


class CastCodec(_Codec):
    """fp16/bf16: a cast; where a value is non-finite or beyond the format's max, NaN -> 0 and
    +-Inf -> +-max in place on the 16-bit result.

    Values just above the format's max round to it in the cast; larger ones become Inf and then the
    max, so the result equals clamping in fp32 before the cast. On CPU one ``aminmax`` pass over
    the input tells whether that fix-up is needed (on CUDA it would be a host sync, so it always runs).
    """

    def __init__(self, precision: str) -> None:
        if precision not in ("fp16", "bf16"):
            raise ValueError(f"CastCodec takes fp16 or bf16, not {precision!r} (fp32 is PassThroughCodec)")
        self.precision = precision
        self._dtype = CAST_DTYPES[precision]
        self._max = torch.finfo(self._dtype).max

    @property
    def quantized_dtype(self) -> torch.dtype:
        return self._dtype

    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        with torch.no_grad():
            out = input_tensor.to(self._dtype, copy=True)
            if input_tensor.device.type == "cpu" and input_tensor.numel():
                low, high = torch.aminmax(input_tensor)
                if -self._max <= float(low) and float(high) <= self._max:  # False for NaN
                    return out
            return torch.nan_to_num_(out, nan=0.0, posinf=self._max, neginf=-self._max)

    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        return input_grad.to(torch.float32)


class BlockScaledCodec(_Codec):
    """fp8 (e4m3/e5m2) or int8 with one fp32 scale per ``block_size`` values, sent as uint8 rows.

    ``block_size`` is the gcd of the plan's shard widths; a codec built before the plan (for the
    planner, which only reads ``quantized_dtype``) has none and refuses to encode.
    """

    def __init__(self, precision: str, block_size: Optional[int] = None) -> None:
        if precision not in BYTE_DTYPES:
            raise ValueError(f"BlockScaledCodec takes one of {list(BYTE_DTYPES)}, not {precision!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"{precision} qcomms: block_size={block_size} must be a positive number of values")
        self.precision = precision
        self._block_size = block_size
        self._dtype = BYTE_DTYPES[precision]
        self._max = 127.0 if precision == "int8" else float(torch.finfo(self._dtype).max)

    @property
    def quantized_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def block_size(self) -> int:
        if self._block_size is None:
            raise RuntimeError(f"the {self.precision} codec's block size is set from the sharding plan before use")
        return self._block_size

    def calc_quantized_size(self, input_len: int, ctx: Optional[Any] = None) -> int:
        # TorchRec sizes each rank's chunk with this and decodes the chunks concatenated, so every
        # chunk must be whole blocks; a shorter tail block is only decodable at the very end.
        size = self.block_size
        if input_len % size:
            raise ValueError(
                f"{self.precision} qcomms: a payload of {input_len} values is not a whole number of blocks of "
                f"{size} (the block size is the gcd of the sharded embedding widths)."
            )
        return input_len // size * (size + SCALE_BYTES)

    def __repr__(self) -> str:
        return f"BlockScaledCodec({self.precision!r}, block_size={self._block_size})"

    # --------------------------------------------------------------------------- encode
    def encode(self, input_tensor: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        """Flat uint8: whole blocks, then (outside TorchRec's aligned payloads) one shorter tail block."""
        size = self.block_size
        with torch.no_grad():
            flat = input_tensor.reshape(-1).to(torch.float32)
            blocks, tail = divmod(flat.numel(), size)
            stride = size + SCALE_BYTES
            out = torch.empty(blocks * stride + (tail + SCALE_BYTES if tail else 0), dtype=torch.uint8, device=flat.device)
            if blocks:
                self._encode_rows(flat[: blocks * size].view(blocks, size), out[: blocks * stride].view(blocks, stride))
            if tail:
                self._encode_rows(flat[blocks * size :].view(1, tail), out[blocks * stride :].view(1, tail + SCALE_BYTES))
            return out

    def _encode_rows(self, values: torch.Tensor, rows: torch.Tensor) -> None:
        size = values.shape[1]
        step = _chunk_rows(values)
        scaled = torch.empty((min(step, values.shape[0]), size), dtype=torch.float32, device=values.device)
        for start in range(0, values.shape[0], step):
            x = values[start : start + step]
            self._encode_chunk(x, scaled[: x.shape[0]], rows[start : start + step], size)

    def _encode_chunk(self, x: torch.Tensor, scaled: torch.Tensor, rows: torch.Tensor, size: int) -> None:
        fmax = self._max
        # On CPU one look at the sum of the block maxima tells whether any value is NaN or +-Inf; on
        # CUDA that look would be a host sync, so it always takes the careful path there.
        careful = True
        if x.device.type == "cpu":
            amax = torch.abs(x, out=scaled).amax(dim=1, keepdim=True)
            careful = not math.isfinite(float(amax.sum()))
        if careful:  # the amax of the finite values only: NaN and +-Inf count as 0
            amax = torch.nan_to_num_(torch.abs(x, out=scaled), nan=0.0, posinf=0.0).amax(dim=1, keepdim=True)
        # A block of zeros gets the smallest normal scale, and so does a block so small that
        # amax / fmax would be subnormal: then |x / scale| < fmax, and the scale keeps full precision.
        scale = amax.div_(fmax).clamp_(min=_TINY)
        torch.div(x, scale, out=scaled)
        if careful:
            torch.nan_to_num_(scaled, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax)
        # Otherwise |x / scale| <= fmax * (1 + 2**-23), which the cast (round to nearest) or the
        # int8 rounding turns into at most fmax: no clamp needed.
        if self._dtype is torch.int8:
            scaled.round_()
        rows[:, :size].view(self._dtype).copy_(scaled)
        _write_scales(rows, size, scale)

    # --------------------------------------------------------------------------- decode
    def decode(self, input_grad: torch.Tensor, ctx: Optional[Any] = None) -> torch.Tensor:
        size = self.block_size
        stride = size + SCALE_BYTES
        blocks, tail = divmod(input_grad.numel(), stride)
        if 0 < tail <= SCALE_BYTES:
            raise ValueError(f"{self.precision} qcomms: {input_grad.numel()} bytes is not a valid encoded payload.")
        with torch.no_grad():
            data = input_grad.reshape(-1)
            out = torch.empty(blocks * size + (tail - SCALE_BYTES if tail else 0), dtype=torch.float32, device=data.device)
            if blocks:
                self._decode_rows(data[: blocks * stride].view(blocks, stride), out[: blocks * size].view(blocks, size))
            if tail:
                self._decode_rows(data[blocks * stride :].view(1, tail), out[blocks * size :].view(1, tail - SCALE_BYTES))
            return out

    def _decode_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        size = out.shape[1]
        scale = _read_scales(rows, size)
        if self._dtype is torch.float8_e4m3fn:
            scale = scale * _E4M3_FP16_FACTOR  # exact: a power of two, and scale <= float32 max / 448
        step = _chunk_rows(out)
        widened = None if self._dtype is torch.int8 else torch.empty((min(step, out.shape[0]), size), dtype=torch.int16, device=out.device)
        for start in range(0, out.shape[0], step):
            payload, dst = rows[start : start + step, :size], out[start : start + step]
            if widened is None:
                dst.copy_(payload.view(torch.int8))
            else:
                bits = widened[: dst.shape[0]]
                if self._dtype is torch.float8_e4m3fn:
                    bits.copy_(payload.view(torch.int8))  # sign-extends: the sign lands in bit 15
                    bits <<= _E4M3_FP16_SHIFT
                    bits &= _E4M3_FP16_MASK
                else:  # an e5m2 byte is the high byte of an fp16
                    bits.copy_(payload)
                    bits <<= 8
                dst.copy_(bits.view(torch.float16))
            dst.mul_(scale[start : start + step])


def _scales_are_aligned(tail: torch.Tensor) -> bool:
    """Whether the scale bytes ``tail`` (n, 4) of uint8 rows can be viewed as (n, 1) fp32 in place."""
    return tail.stride(0) % SCALE_BYTES == 0 and tail.storage_offset() % SCALE_BYTES == 0 and tail.data_ptr() % SCALE_BYTES == 0


def _read_scales(rows: torch.Tensor, size: int) -> torch.Tensor:
    tail = rows[:, size:]
    if _scales_are_aligned(tail):
        return tail.view(torch.float32)
    return tail.clone(memory_format=torch.contiguous_format).view(torch.float32)  # fresh storage: 4-byte aligned


def _write_scales(rows: torch.Tensor, size: int, scale: torch.Tensor) -> None:
    tail = rows[:, size:]
    if _scales_are_aligned(tail):
        tail.view(torch.float32).copy_(scale)
    else:
        tail.copy_(scale.view(torch.uint8).view(-1, SCALE_BYTES))


def _chunk_rows(values: torch.Tensor) -> int:
    """Rows per chunk: about ``_CHUNK_VALUES`` values on CPU, everything at once elsewhere."""
    if values.device.type != "cpu":
        return max(1, values.shape[0])
    return max(1, _CHUNK_VALUES // max(1, values.shape[1]))


# ------------------------------------------------------------------------------- FBGEMM
def fbgemm_unsupported(precision: str, block_size: Optional[int], device: torch.device) -> Optional[str]:
    """Why FBGEMM's fused rowwise codec cannot carry ``precision`` here, or None when it can
    (``block_size`` None: not known yet, so not checked)."""
    if precision not in BYTE_DTYPES:
        return f"FBGEMM's {precision} codec is a plain torch cast (fbgemm_gpu.quantize_utils), no fused kernel"
    op = "FloatToFused8BitRowwiseQuantized" if precision == "int8" else "FloatToFP8RowwiseQuantized"
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        import fbgemm_gpu.quantize_comm  # noqa: F401  (registers torch.ops.fbgemm)

        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{op}", key)
    except Exception as err:  # a missing or broken fbgemm_gpu
        return f"fbgemm_gpu cannot be used ({type(err).__name__}: {err})"
    if precision != "int8" and device.type != "cuda":
        return f"FBGEMM's fp8 kernel runs on CUDA only (fbgemm::{op} raises 'fp8 is not supported by CPU')"
    if not has_kernel:
        return f"this fbgemm_gpu build has no {key} kernel for fbgemm::{op}"
    if precision == "int8" and block_size is not None and block_size % 32:
        return (
            f"FBGEMM's int8 codec quantizes rows of 32 values (QuantizationContext's default row_dim), "
            f"which blocks of {block_size} values do not divide into"
        )
    return None


def fbgemm_codec(precision: str, block_size: int) -> Any:
    """FBGEMM's rowwise codec for ``precision``: fp8 rows of ``block_size`` (TorchRec's
    ``fp8_quantize_dim``; e4m3 is FBGEMM's forward layout, e5m2 its backward one), int8 rows of 32."""
    from fbgemm_gpu.quantize_comm import QuantizedCommCodec
    from fbgemm_gpu.split_embedding_configs import SparseType

    if precision == "int8":
        return QuantizedCommCodec(comm_precision=SparseType.INT8)
    return QuantizedCommCodec(comm_precision=SparseType.FP8, row_dim=block_size, is_fwd=precision == "fp8_e4m3")
