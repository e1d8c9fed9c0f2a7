"""QComms codecs and config, in one process: round trips, non-finite values, effective precisions."""

import pytest
import torch
from torchrec.distributed.types import CommOp

from lightning_recsys import QCommsConfig, TwoDRecStrategy
from lightning_recsys.parallel.qcomms import BlockScaledCodec, BlockSize, CastCodec, QCommsCodecs, resolve_qcomms

BLOCK = 16
SHAPES = [(64, BLOCK), (7, 3 * BLOCK), (5, 11), (37,), (0, BLOCK), (0,)]


def _codec(precision: str):
    return CastCodec(precision) if precision in ("fp32", "fp16", "bf16") else BlockScaledCodec(precision, BlockSize(BLOCK))


def _round_trip(precision: str, x: torch.Tensor) -> torch.Tensor:
    codec = _codec(precision)
    return codec.decode(codec.encode(x)).view_as(x)


def _max_relative_error(x: torch.Tensor, y: torch.Tensor, floor: float) -> float:
    """Elementwise |y - x| / |x| over the values of at least ``floor`` times their block's max magnitude."""
    if x.numel() == 0:
        return 0.0
    flat = x.reshape(-1)
    block_max = torch.cat([b.abs().max().expand(b.numel()) for b in flat.split(BLOCK)])
    keep = flat.abs() >= floor * block_max
    return float(((y.reshape(-1) - flat).abs() / flat.abs())[keep].max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    ("precision", "bound", "floor"),
    [
        ("fp16", 5e-3, 0.0),
        ("bf16", 5e-3, 0.0),
        # fp8 has 3 (e4m3) mantissa bits: relative rounding error <= 2**-4 / (1 + 2**-4) = 0.0588 for
        # values in its normal range, i.e. down to 2**-14 of the block maximum (e4m3 spans 2**-6..448).
        ("fp8_e4m3", 6e-2, 2.0**-14),
    ],
)
def test_round_trip_error_is_bounded(precision, bound, floor, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, steps=max(1, shape[0]))[: shape[0]].reshape(-1, *[1] * (len(shape) - 1))
    y = _round_trip(precision, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert _max_relative_error(x, y, floor) <= bound


@pytest.mark.parametrize("precision", ["fp8_e5m2", "int8"])
def test_coarser_formats_stay_within_their_resolution(precision):
    torch.manual_seed(0)
    x = torch.randn(9, BLOCK)
    y = _round_trip(precision, x)
    # int8: half a step of amax/127; e5m2: 2 mantissa bits, relative error <= 2**-3.
    if precision == "int8":
        assert (y - x).abs().max() <= x.abs().max() / 127 / 2 * 1.0001
    else:
        assert _max_relative_error(x, y, 2.0**-14) <= 2**-3


def test_byte_payload_is_a_quarter_of_fp32_plus_the_scales():
    codec = BlockScaledCodec("fp8_e4m3", BlockSize(64))
    encoded = codec.encode(torch.randn(10, 64))
    assert encoded.dtype == torch.uint8 and encoded.numel() == 10 * (64 + 4) == codec.calc_quantized_size(640)
    assert CastCodec("bf16").encode(torch.randn(3)).dtype == torch.bfloat16  # really bf16, on every backend


def test_concatenated_chunks_decode_like_the_all_to_all_receives_them():
    codec = BlockScaledCodec("fp8_e4m3", BlockSize(8))
    chunks = [torch.randn(3 * 8), torch.randn(5 * 8)]
    received = torch.cat([codec.encode(c) for c in chunks])
    torch.testing.assert_close(codec.decode(received), torch.cat(chunks), rtol=6e-2, atol=0)


def test_unaligned_collective_payload_is_a_clear_error():
    with pytest.raises(ValueError, match=r"fp8_e4m3 qcomms: a payload of 10 values is not a whole number of blocks of 8"):
        BlockScaledCodec("fp8_e4m3", BlockSize(8)).calc_quantized_size(10)
    with pytest.raises(RuntimeError, match=r"block size is set from the sharding plan"):
        BlockScaledCodec("int8").encode(torch.ones(4))


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_non_finite_values_are_clamped_as_documented(precision):
    x = torch.tensor([[1.0, -2.0, float("nan"), float("inf"), float("-inf"), 3.0, 0.5, 1e6]] * 2).repeat(1, 2)
    y = _round_trip(precision, x)
    assert torch.isfinite(y).all()
    assert (y[:, 2] == 0).all()
    if precision in ("fp16", "bf16"):
        fmax = torch.finfo(getattr(torch, "float16" if precision == "fp16" else "bfloat16")).max
        assert (y[:, 3] == fmax).all() and (y[:, 4] == -fmax).all()
    else:
        # Saturates to the block's largest finite magnitude (1e6 here), not to the format's max.
        torch.testing.assert_close(y[:, 3], torch.full((2,), 1e6), rtol=6e-2, atol=0)
        torch.testing.assert_close(y[:, 4], torch.full((2,), -1e6), rtol=6e-2, atol=0)


def test_reduce_scatter_falls_back_from_byte_formats_and_says_so():
    effective = resolve_qcomms(QCommsConfig.preset("fp8"))
    assert effective.precisions == {
        "pooled_all_to_all": ("fp8_e4m3", "fp8_e5m2"),
        "sequence_all_to_all": ("fp8_e4m3", "fp8_e5m2"),
        "reduce_scatter": ("bf16", "bf16"),
    }
    assert effective.fallbacks == (
        "reduce_scatter forward: fp8 cannot be summed on the wire, using bf16 instead",
        "reduce_scatter backward: fp8 cannot be summed on the wire, using bf16 instead",
    )
    only_a2a = resolve_qcomms(QCommsConfig(forward="fp16", backward="bf16", collectives=("pooled_all_to_all",)))
    assert only_a2a.precisions["reduce_scatter"] == ("fp32", "fp32") and not only_a2a.fallbacks


def test_registry_holds_codecs_for_the_quantized_collectives_only():
    codecs = QCommsCodecs.build(resolve_qcomms(QCommsConfig(forward="fp8", backward="bf16", collectives=("pooled_all_to_all",))))
    assert set(codecs.registry) == {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name}
    pooled = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    assert pooled.forward.quantized_dtype == torch.uint8 and pooled.backward.quantized_dtype == torch.bfloat16
    assert QCommsCodecs.build(resolve_qcomms(QCommsConfig())).registry is None


def test_strategy_takes_a_preset_or_a_config():
    assert TwoDRecStrategy(qcomms="fp8").effective_qcomms.precisions["pooled_all_to_all"] == ("fp8_e4m3", "fp8_e5m2")
    config = QCommsConfig(forward="fp8", backward="bf16", dense_grads="bf16")
    assert TwoDRecStrategy(qcomms=config).effective_qcomms.dense_grads == "bf16"
    assert TwoDRecStrategy().effective_qcomms.is_off


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"forward": "fp4"}, r"QCommsConfig\(forward='fp4'\) is not one of \['fp32', 'bf16', 'fp16', 'fp8', 'int8'\]"),
        ({"collectives": ("all_reduce",)}, r"collectives=\['all_reduce'\]\) must be a non-empty subset of"),
        ({"fp8_backward_format": "e3m4"}, r"fp8_backward_format='e3m4'\) is not one of \['e4m3', 'e5m2'\]"),
        ({"dense_grads": "fp8"}, r"dense_grads='fp8'\) is not one of \['fp32', 'bf16', 'fp16'\]"),
    ],
)
def test_invalid_config_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QCommsConfig(**kwargs)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"qcomms='fp4' is not a preset; choose one of \['fp32', 'bf16', 'fp16', 'fp8', 'int8'\]"):
        TwoDRecStrategy(qcomms="fp4")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_cuda_encoding_is_the_same_format_as_cpu(precision):
    torch.manual_seed(0)
    x = torch.randn(33, BLOCK) * 3
    codec = _codec(precision)
    on_cpu, on_cuda = codec.encode(x), codec.encode(x.cuda())
    assert on_cuda.dtype == on_cpu.dtype and on_cuda.shape == on_cpu.shape
    # Same wire format: the CUDA bytes decode on the CPU to the CPU round trip, within one rounding step.
    torch.testing.assert_close(codec.decode(on_cuda.cpu()), codec.decode(on_cpu), rtol=0.13, atol=1e-6)
