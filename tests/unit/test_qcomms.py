"""QComms codecs and config, in one process: round trips, non-finite values, effective precisions."""


import pytest
import torch
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import CommOp, EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from lightning_recsys import QCommsConfig, TwoDRecStrategy
from lightning_recsys.parallel.comms import codecs as codecs_module
from lightning_recsys.parallel.comms.qcomms import (
    BlockScaledCodec,
    CastCodec,
    PassThroughCodec,
    QCommsCodecs,
    make_codec,
    resolve_qcomms,
    wire_bytes_per_value,
)

BLOCK = 16
SHAPES = [(64, BLOCK), (7, 3 * BLOCK), (5, 11), (37,), (0, BLOCK), (0,)]
FMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
WIRE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def _codec(precision: str):
    return CastCodec(precision) if precision in ("fp16", "bf16") else BlockScaledCodec(precision, BLOCK)


def _round_trip(precision: str, x: torch.Tensor) -> torch.Tensor:
    codec = _codec(precision)
    return codec.decode(codec.encode(x)).view_as(x)


def _plan(*widths: int) -> ShardingPlan:
    """A column-wise plan whose shards have ``widths``."""
    shards = [ShardMetadata(shard_offsets=[0, sum(widths[:i])], shard_sizes=[10, w], placement=f"rank:{i}/cpu") for i, w in enumerate(widths)]
    sharding = ParameterSharding(sharding_type="column_wise", compute_kernel="fused", ranks=list(range(len(widths))),
                                 sharding_spec=EnumerableShardingSpec(shards))
    return ShardingPlan(plan={"ebc": EmbeddingModuleShardingPlan({"t0": sharding})})


def _reference_encode(precision: str, x: torch.Tensor, size: int) -> torch.Tensor:
    """The block-scaled wire bytes the straightforward way: whole-tensor ops, one after the other."""
    fmax, flat = FMAX[precision], x.reshape(-1).float()
    whole = flat.numel() // size * size
    parts = []
    for blocks in (flat[:whole].view(-1, size), flat[whole:].view(1, -1)):
        if blocks.numel():
            amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=1, keepdim=True)
            scale = (amax / fmax).clamp(min=torch.finfo(torch.float32).tiny)
            scaled = torch.nan_to_num(blocks / scale, nan=0.0, posinf=fmax, neginf=-fmax).clamp(-fmax, fmax)
            scaled = scaled.round() if precision == "int8" else scaled
            parts.append(torch.cat([scaled.to(WIRE_DTYPES[precision]).view(torch.uint8), scale.view(torch.uint8)], dim=1).reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _reference_decode(precision: str, encoded: torch.Tensor, size: int) -> torch.Tensor:
    stride = size + 4
    whole = encoded.numel() // stride * stride
    parts = []
    for rows, width in ((encoded[:whole].view(-1, stride), size), (encoded[whole:].view(1, -1), encoded.numel() - whole - 4)):
        if rows.numel():
            payload = rows[:, :width].contiguous().view(WIRE_DTYPES[precision]).to(torch.float32)
            parts.append((payload * rows[:, width:].clone(memory_format=torch.contiguous_format).view(torch.float32)).reshape(-1))
    return torch.cat(parts) if parts else torch.empty(0)


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
    codec = BlockScaledCodec("fp8_e4m3", 64)
    encoded = codec.encode(torch.randn(10, 64))
    assert encoded.dtype == torch.uint8 and encoded.numel() == 10 * (64 + 4) == codec.calc_quantized_size(640)
    assert CastCodec("bf16").encode(torch.randn(3)).dtype == torch.bfloat16  # really bf16, on every backend


def test_concatenated_chunks_decode_like_the_all_to_all_receives_them():
    codec = BlockScaledCodec("fp8_e4m3", 8)
    chunks = [torch.randn(3 * 8), torch.randn(5 * 8)]
    received = torch.cat([codec.encode(c) for c in chunks])
    torch.testing.assert_close(codec.decode(received), torch.cat(chunks), rtol=6e-2, atol=0)


def test_unaligned_collective_payload_is_a_clear_error():
    with pytest.raises(ValueError, match=r"fp8_e4m3 qcomms: a payload of 10 values is not a whole number of blocks of 8"):
        BlockScaledCodec("fp8_e4m3", 8).calc_quantized_size(10)
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


def _payloads() -> list[tuple[str, torch.Tensor, int]]:
    torch.manual_seed(0)
    spread = torch.randn(300, BLOCK) * torch.logspace(-30, 30, 300).unsqueeze(1)
    special = torch.randn(8, BLOCK)
    special[0] = 0.0  # a block of zeros
    special[1] *= 1e-40  # subnormal values: amax / fmax is below the smallest normal scale
    special[2] = 3e38 * torch.sign(special[2])  # at the top of the fp32 range
    special[3, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    special[4] = float("inf")  # no finite value at all
    many = torch.randn((1 << 18) // 8 * 3 + 5, 8)  # several chunks of the CPU loop
    many[-7, 2] = float("nan")  # a non-finite value in the last chunk only
    return [
        ("spread", spread, BLOCK),
        ("special", special, BLOCK),
        ("tail", torch.randn(7 * BLOCK + 5), BLOCK),
        ("unaligned scales", torch.randn(9, 11), 11),
        ("several chunks", many, 8),
        ("empty", torch.empty(0), BLOCK),
    ]


@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("case", range(6), ids=["spread", "special", "tail", "unaligned scales", "several chunks", "empty"])
def test_block_scaled_bytes_are_those_of_the_straightforward_codec(precision, case):
    """The fast codec writes the very bytes (and decodes to the very floats) of whole-tensor torch ops."""
    _, x, size = _payloads()[case]
    codec = BlockScaledCodec(precision, size)
    encoded = codec.encode(x)
    assert torch.equal(encoded, _reference_encode(precision, x, size))
    decoded = codec.decode(encoded)
    assert torch.equal(decoded.view(torch.int32), _reference_decode(precision, encoded, size).view(torch.int32))


@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_every_payload_byte_decodes_like_torchs_cast(precision):
    dtype = WIRE_DTYPES[precision]
    codes = torch.arange(256, dtype=torch.uint8)
    rows = torch.cat([codes, torch.tensor([1.0]).view(torch.uint8)])  # one block of 256, scale 1
    decoded = BlockScaledCodec(precision, 256).decode(rows)
    expected = codes.view(dtype).to(torch.float32)
    nan = torch.isnan(expected)  # e4m3fn's two NaN codes are never written by the encoder
    assert torch.equal(decoded[~nan], expected[~nan])
    if precision == "fp8_e5m2":
        assert torch.isnan(decoded[nan]).all()


def test_an_fp32_direction_is_a_pure_pass_through():
    """forward fp8 + backward fp32: the backward codec must change no value, NaN and Inf included."""
    codecs = QCommsCodecs.build(resolve_qcomms(QCommsConfig(forward="fp8", backward="fp32")), _plan(64))
    backward = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].backward
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 3.4e38, -3.4e38, 1e-45, 1.5])
    x = torch.cat([x, torch.tensor([0x7FC12345], dtype=torch.int32).view(torch.float32)])  # a NaN with a payload
    encoded = backward.encode(x)
    assert encoded.dtype == torch.float32 and torch.equal(encoded.view(torch.int32), x.view(torch.int32))
    assert torch.equal(backward.decode(encoded).view(torch.int32), x.view(torch.int32))
    assert isinstance(backward, PassThroughCodec) and backward.quantized_dtype == torch.float32


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


@pytest.mark.parametrize(
    ("widths", "block", "falls_back"),
    [((4, 6), 2, True), ((4, 8), 4, True), ((8, 24), 8, False), ((64,), 64, False)],
)
@pytest.mark.parametrize("preset", ["fp8", "int8"])
def test_tiny_blocks_fall_back_to_bf16_and_say_so(preset, widths, block, falls_back):
    """A byte format sends 1 + 4 / block bytes per value: at blocks of 4 or fewer, bf16 (2) is no bigger."""
    requested = resolve_qcomms(QCommsConfig.preset(preset))
    codecs = QCommsCodecs.build(requested, _plan(*widths))
    pooled = codecs.effective.precisions["pooled_all_to_all"]
    forward = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    assert codecs.block_size == block == codecs.effective.block_size
    name = requested.precisions["pooled_all_to_all"][0]
    notes = [f for f in codecs.effective.fallbacks if f.startswith("pooled_all_to_all forward")]
    if falls_back:
        assert pooled[0] == "bf16" and isinstance(forward, CastCodec) and forward.quantized_dtype == torch.bfloat16
        assert notes == [
            f"pooled_all_to_all forward: {name} with a 4-byte scale per block of {block} values (the gcd of the plan's "
            f"shard widths) sends {1 + 4 / block:.2f} bytes per value, not fewer than bf16's 2; using bf16 instead"
        ]
        assert codecs.effective.wire_bytes("pooled_all_to_all")[0] == 2.0
    else:
        assert pooled[0] == name and isinstance(forward, BlockScaledCodec) and forward.block_size == block
        assert notes == [] and codecs.effective.wire_bytes("pooled_all_to_all")[0] == 1 + 4 / block
        assert f"fp8/int8 scale blocks: {block} values" in codecs.effective.describe()
    assert requested.fallbacks == codecs.requested.fallbacks  # the request itself is left as it was


def test_planning_codecs_refuse_to_encode_and_final_ones_are_built_from_the_plan():
    requested = resolve_qcomms(QCommsConfig.preset("fp8"))
    planning = QCommsCodecs.build(requested)
    with pytest.raises(RuntimeError, match="block size is set from the sharding plan"):
        planning.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward.encode(torch.ones(4))
    narrow = QCommsCodecs.build(requested, _plan(4, 6))
    assert narrow.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward.quantized_dtype == torch.bfloat16
    assert narrow.effective.precisions["pooled_all_to_all"] == ("bf16", "bf16") and len(narrow.effective.fallbacks) == 6
    wide = QCommsCodecs.build(requested, _plan(32, 64))  # each plan starts from the request
    assert wide.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward.block_size == 32
    assert wide.effective.precisions["pooled_all_to_all"] == ("fp8_e4m3", "fp8_e5m2") and len(wide.effective.fallbacks) == 2


def test_a_plan_without_sharded_tables_has_no_block_and_no_fallback():
    data_parallel = ShardingPlan(plan={"ebc": EmbeddingModuleShardingPlan({"t0": ParameterSharding("data_parallel", "dense")})})
    codecs = QCommsCodecs.build(resolve_qcomms(QCommsConfig.preset("fp8")), data_parallel)
    assert codecs.block_size is None and codecs.effective.precisions["pooled_all_to_all"] == ("fp8_e4m3", "fp8_e5m2")
    assert len(codecs.effective.fallbacks) == 2  # the reduce-scatter ones only


def test_wire_bytes_per_value_per_precision():
    assert [wire_bytes_per_value(p) for p in ("fp32", "fp16", "bf16")] == [4.0, 2.0, 2.0]
    assert wire_bytes_per_value("fp8_e4m3", 64) == wire_bytes_per_value("int8", 64) == 1.0625
    # FBGEMM: fp8 rows [row padded to 4 | fp32 scale | 4 bytes], int8 rows of 32 [row | fp32 scale | fp32 bias].
    assert wire_bytes_per_value("fp8_e5m2", 64, fbgemm=True) == 72 / 64
    assert wire_bytes_per_value("fp8_e4m3", 6, fbgemm=True) == 16 / 6
    assert wire_bytes_per_value("int8", 64, fbgemm=True) == 40 / 32


def test_auto_kernels_on_cpu_are_the_torch_codecs():
    codecs = QCommsCodecs.build(resolve_qcomms(QCommsConfig(forward="fp8", backward="int8")), _plan(64), device="cpu")
    pooled = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name]
    assert isinstance(pooled.forward, BlockScaledCodec) and isinstance(pooled.backward, BlockScaledCodec)
    assert codecs.effective.fbgemm == () and "FBGEMM" not in codecs.effective.describe()


def test_fbgemm_int8_kernel_runs_on_cpu_when_asked_for():
    effective = resolve_qcomms(QCommsConfig(forward="int8", backward="bf16", collectives=("pooled_all_to_all",), kernels="fbgemm"))
    codecs = QCommsCodecs.build(effective, _plan(32, 64))
    forward = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    assert type(forward).__module__ == "fbgemm_gpu.quantize_comm" and codecs.effective.fbgemm == (("pooled_all_to_all", "forward"),)
    assert "pooled_all_to_all: forward int8 (FBGEMM), backward bf16" in codecs.effective.describe()
    torch.manual_seed(0)
    x = torch.randn(40 * 32)
    ctx = forward.create_context()
    encoded = forward.encode(x, ctx)
    assert encoded.dtype == torch.uint8 and encoded.numel() == forward.calc_quantized_size(x.numel(), ctx) == 40 * 40
    ours = _reference_decode("int8", _reference_encode("int8", x, 32), 32)
    # FBGEMM scales min..max to 0..255 per row of 32 (half a step of (max - min) / 255); ours -amax..amax to -127..127.
    row_range = (x.view(-1, 32).amax(1) - x.view(-1, 32).amin(1)).repeat_interleave(32)
    assert ((forward.decode(encoded, ctx) - x).abs() <= row_range / 255 / 2 * 1.0001).all()
    assert (ours - x).abs().max() <= x.abs().max() / 127 / 2 * 1.0001


@pytest.mark.parametrize(
    ("config", "plan", "message"),
    [
        (QCommsConfig(forward="fp8", kernels="fbgemm"), None, r"pooled_all_to_all forward fp8_e4m3 on cpu: FBGEMM's fp8 kernel runs on CUDA only"),
        (QCommsConfig(forward="int8", kernels="fbgemm"), _plan(16), r"int8 codec quantizes rows of 32 values .*blocks of 16"),
    ],
)
def test_fbgemm_kernels_are_refused_with_the_reason(config, plan, message):
    with pytest.raises(ValueError, match=r"QCommsConfig\(kernels='fbgemm'\): .*" + message + r".*kernels='auto'"):
        QCommsCodecs.build(resolve_qcomms(config), plan)


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
        ({"kernels": "cuda"}, r"kernels='cuda'\) is not one of \['auto', 'torch', 'fbgemm'\]"),
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


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "bound"), [("fp8_e4m3", 2.0**-4), ("fp8_e5m2", 2.0**-3), ("int8", None)])
def test_fbgemm_kernels_on_cuda_agree_with_the_torch_codecs(precision, bound):
    """On CUDA, kernels='auto' picks FBGEMM's fused kernels for the all-to-alls; they round-trip like ours."""
    config = QCommsConfig(forward="int8" if precision == "int8" else "fp8", backward="fp8",
                          fp8_forward_format=precision.removeprefix("fp8_") if precision != "int8" else "e4m3")
    why_not = codecs_module.fbgemm_unsupported(precision, 64, torch.device("cuda"))
    if why_not is not None:
        pytest.skip(why_not)
    codecs = QCommsCodecs.build(resolve_qcomms(config), _plan(64, 64), device="cuda")
    fbgemm = codecs.registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    assert ("pooled_all_to_all", "forward") in codecs.effective.fbgemm and type(fbgemm).__module__ == "fbgemm_gpu.quantize_comm"
    torch.manual_seed(0)
    x = (torch.randn(512, 64) * torch.logspace(-2, 2, 512).unsqueeze(1)).cuda().reshape(-1)
    ctx = fbgemm.create_context()
    encoded = fbgemm.encode(x, ctx)
    assert encoded.numel() == fbgemm.calc_quantized_size(x.numel(), ctx) == x.numel() * codecs.effective.wire_bytes("pooled_all_to_all")[0]
    theirs = fbgemm.decode(encoded, ctx).view(-1, 64)
    ours = make_codec(precision, 64).decode(make_codec(precision, 64).encode(x)).view(-1, 64)
    rows = x.view(-1, 64)
    row_max = rows.abs().amax(1, keepdim=True)
    if bound is None:  # int8: half a step of the row's range, theirs (rows of 32, min..max) and ours
        assert ((theirs - rows).abs() <= row_max * 2 / 255 / 2 * 1.001).all()
        assert ((ours - rows).abs() <= row_max / 127 / 2 * 1.001).all()
    else:  # values at least 2**-6 of their row's max are in both formats' normal ranges
        keep = rows.abs() >= row_max * 2.0**-6
        relative = lambda decoded: ((decoded - rows).abs() / rows.abs())[keep].max()  # noqa: E731
        assert relative(ours) <= bound * 1.001  # half a step: round to nearest
        assert relative(theirs) <= 2 * bound * 1.001  # within one step of FBGEMM's HFP8 rounding
