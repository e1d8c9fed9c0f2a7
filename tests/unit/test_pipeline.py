"""The planning pipeline in one process: ranks are simulated by replaying what rank 0 broadcast."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel import ParallelTopology, ReshapedEmbeddingBagCollection, make_sharders
from lightning_recsys.planner.collective import on_rank_zero
from lightning_recsys.planner.pipeline import PlanningConfig, PlanningPipeline
from lightning_recsys.planner.stats import TableStats

TOPOLOGY = ParallelTopology(world_size=2, sharding_group_size=2, ranks_per_node=2)


class Recorder:
    """Rank 0's broadcast: keeps what it sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def __call__(self, obj: object) -> object:
        self.sent.append(obj)
        return obj


class Replay:
    """Another rank's broadcast: receives what rank 0 sent, in order."""

    def __init__(self, sent: list[object]) -> None:
        self.sent = list(sent)

    def __call__(self, obj: object) -> object:
        assert obj is None, "only rank 0 puts something into a broadcast"
        return self.sent.pop(0)


def _model(table_sizes=(64, 96), dim: int = 16) -> DLRMRanker:
    return DLRMRanker(table_sizes=list(table_sizes), embedding_dim=dim, dense_arch_layer_sizes=[8, dim], embedding_device="meta")


def _pipeline(config: PlanningConfig, *, rank: int = 0, broadcast=None) -> PlanningPipeline:
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params())
    kwargs = {"broadcast": broadcast} if broadcast is not None else {}
    return PlanningPipeline(config, sharders=sharders, topology=TOPOLOGY, compute_device="cpu", rank=rank, **kwargs)


@pytest.mark.parametrize(
    ("error", "rebuilt"),
    [
        (ValueError("hash_partitions['t']=3 ..."), ValueError),
        (PlannerError("table 't' needs at least 3 GiB", PlannerErrorType.PARTITION), PlannerError),
        (OSError("disk"), OSError),
        (torch.cuda.OutOfMemoryError("oom"), RuntimeError),  # not a builtin: a RuntimeError naming it
    ],
)
def test_what_rank_zero_raises_every_rank_raises(error, rebuilt):
    def fail():
        raise error

    rank0 = Recorder()
    with pytest.raises(type(error)) as on_zero:
        on_rank_zero(fail, rank=0, broadcast=rank0)
    assert on_zero.value is error
    with pytest.raises(rebuilt, match=str(error).replace("[", r"\[").split(" ...")[0]) as on_one:
        on_rank_zero(lambda: pytest.fail("rank 1 must not plan"), rank=1, broadcast=Replay(rank0.sent))
    if isinstance(error, PlannerError):
        assert on_one.value.error_type == PlannerErrorType.PARTITION


def test_both_planners_get_the_profiled_batch_size_and_pooling_factors():
    config = SyntheticClickLogConfig(table_sizes=[64, 96], pooling_factors=[3.0, 1.0], global_batch_size=32, train_batches=3)
    model = _model(config.table_sizes)
    for planner in ("torchrec", "balanced"):
        pipeline = _pipeline(PlanningConfig(planner=planner, profile_batches=2))
        inputs = pipeline.prepare(model, SyntheticClickLogDataModule.from_config(config), setup_datamodule=True)
        assert inputs.batch_size == 32  # no Trainer: whole global batches
        assert inputs.stats is not None and inputs.stats["t_sparse_0"].pooling_factor > 2 * inputs.stats["t_sparse_1"].pooling_factor
        planned = pipeline.plan(model, inputs)
        assert planned.report is not None and planned.report.batch_size == 32
        assert {t.stats_source for t in planned.report.tables} == {"profiled"}
    torchrec = _pipeline(PlanningConfig(planner="torchrec"))._planner("torchrec", inputs)
    told = torchrec._constraints["t_sparse_0"].pooling_factors  # what TorchRec's estimators see
    assert told == [pytest.approx(inputs.stats["t_sparse_0"].pooling_factor)] and torchrec._batch_size == 32


def test_stats_given_and_a_profile_are_told_apart_and_both_together_warn():
    # The report called given statistics "observed", and a profile replaced them without a word.
    config = SyntheticClickLogConfig(table_sizes=[64, 96], global_batch_size=32, train_batches=3)
    given = {"t_sparse_0": TableStats(pooling_factor=2.0)}
    planned = _pipeline(PlanningConfig(table_stats=given)).run(_model(config.table_sizes))
    assert {t.name: t.stats_source for t in planned.report.tables} == {"t_sparse_0": "given", "t_sparse_1": "assumed"}
    both = _pipeline(PlanningConfig(table_stats=given, profile_batches=2))
    with pytest.warns(UserWarning, match=r"table_stats=...\) for \['t_sparse_0'\] is replaced by the profile of 2 training batches"):
        inputs = both.prepare(_model(config.table_sizes), SyntheticClickLogDataModule.from_config(config), setup_datamodule=True)
    assert inputs.stats_source == "profiled"


def test_other_ranks_get_rank_zeros_plan_and_reshape():
    stats = {"t_sparse_0": TableStats(pooling_factor=1.0), "t_sparse_1": TableStats(pooling_factor=1.0)}
    config = PlanningConfig(planner="balanced", table_stats=stats, reshape_tables=True)
    rank0 = Recorder()
    on_zero = _pipeline(config, broadcast=rank0).run(_model())
    assert on_zero.inputs.reshape and on_zero.report is not None

    other_model = _model()
    on_one = _pipeline(config, rank=1, broadcast=Replay(rank0.sent)).run(other_model)
    assert on_one.plan == on_zero.plan and on_one.report is None  # reported on rank 0 only
    assert any(isinstance(m, ReshapedEmbeddingBagCollection) for m in other_model.modules())  # rank 1 reshaped too


def test_a_planning_error_on_rank_zero_reaches_the_other_ranks():
    config = PlanningConfig(hash_partitions={"t_sparse_0": 3})  # 64 rows do not split into 3 partitions
    rank0 = Recorder()
    with pytest.raises(ValueError, match=r"hash_partitions\['t_sparse_0'\]=3"):
        _pipeline(config, broadcast=rank0).run(_model())
    with pytest.raises(ValueError, match=r"hash_partitions\['t_sparse_0'\]=3"):
        _pipeline(config, rank=1, broadcast=Replay(rank0.sent)).run(_model())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"planner": "greedy"}, r"planner='greedy'\) is not one of \['torchrec', 'balanced'\]"),
        ({"profile_batches": -1}, r"profile_batches=-1\) must be an integer >= 0"),
        ({"table_constraints": {"t": {"sharding_types": ["row_wise"]}}}, r"table_constraints\['t'\] must be a TableConstraints"),
        ({"table_stats": {"t": 2.0}}, r"table_stats\['t'\] must be a TableStats"),
        ({"hash_partitions": {"t": 0}}, r"hash_partitions\['t'\]=0 must be an integer >= 1"),
    ],
)
def test_planning_config_names_the_bad_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PlanningConfig(**kwargs)


def test_planning_config_takes_our_constraints():
    config = PlanningConfig(table_constraints={"t_sparse_0": TableConstraints(sharding_types=["table_wise"])})
    planned = _pipeline(config).run(_model())
    assert next(t for t in planned.report.tables if t.name == "t_sparse_0").sharding_type == "table_wise"


def test_a_dim_the_fused_kernels_cannot_take_is_refused_before_planning_naming_the_table():
    with pytest.raises(ValueError, match=r"'t_sparse_0' \(dim 6\), 't_sparse_1' \(dim 6\): embedding_dim must be a multiple of 4"):
        _pipeline(PlanningConfig()).run(_model(dim=6))
    # A table that may only be data_parallel takes any dim (it does not use the fused kernels).
    data_parallel = PlanningConfig(table_constraints={name: TableConstraints(sharding_types=["data_parallel"]) for name in ("t_sparse_0", "t_sparse_1")})
    assert _pipeline(data_parallel).run(_model(dim=6)).plan is not None


def test_torchrecs_out_of_storage_error_names_the_largest_tables():
    # TorchRec's PlannerError gave storage totals and a shard size, but named no table.
    config = PlanningConfig(planner="torchrec")
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params())
    pipeline = PlanningPipeline(config, sharders=sharders, topology=TOPOLOGY, compute_device="cpu", memory_per_rank=20_000_000)
    with pytest.raises(PlannerError, match=r"insufficient storage(.|\n)*The largest tables .*: 't_sparse_1' 200000 x 64 \(48.83 MiB\), "
                       r"'t_sparse_0' 100000 x 64 \(24.41 MiB\)\. Fix: .*planner='balanced'"):
        pipeline.run(_model(table_sizes=(100_000, 200_000), dim=64))


def test_sequence_tables_with_only_data_parallel_allowed_on_cpu_are_told_why():
    # The message said "The planner may use {} there", with no reason.
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from lightning_recsys.planner import model_tables
    from lightning_recsys.planner.constraints import check_table_options

    module = EmbeddingCollection(tables=[EmbeddingConfig(name="seq", embedding_dim=8, num_embeddings=10, feature_names=["f"])], device=torch.device("meta"))
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params(), ["data_parallel"])
    with pytest.raises(ValueError, match=r"table 'seq' \(EmbeddingCollection\): .* No sharding type of PlanningConfig\(sharding_types\) runs "
                       r"EmbeddingCollection tables there \(data_parallel is not offered for sequence tables on CPU"):
        check_table_options(model_tables(module), sharders, "cpu")


@pytest.mark.parametrize("planner", ["torchrec", "balanced"])
def test_row_wise_tables_that_leave_a_rank_no_rows_are_refused_on_cpu(planner):
    # TorchRec cut 3- and 5-row tables over 4 ranks into blocks of 1 and 2 rows, so rank 3 got only empty
    # shards; FBGEMM's CPU kernel then raised "weights[0] must be a GPU or MTIA tensor" at the first step.
    config = PlanningConfig(planner=planner, sharding_types=["row_wise"])
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params(), ["row_wise"])
    four = ParallelTopology(world_size=4, sharding_group_size=4, ranks_per_node=4)

    def run(table_sizes, device="cpu"):
        return PlanningPipeline(config, sharders=sharders, topology=four, compute_device=device).run(_model(table_sizes))

    with pytest.raises(ValueError, match=r"the row_wise tables 't_sparse_0' \(3 rows\), 't_sparse_1' \(5 rows\) \(compute kernel fused\) "
                       r"leave rank\(s\) \[3\] of each sharding group of 4 ranks with 0 rows"):
        run((3, 5))
    assert run((3, 40)).plan is not None  # rank 3 has rows of the larger table: one kernel, not empty
    assert run((3, 5), device="cuda").plan is not None  # FBGEMM's CUDA kernels take an empty shard


@pytest.mark.parametrize("planner", ["torchrec", "balanced"])
@pytest.mark.parametrize(
    ("allowed", "constraint", "asked"),
    [
        (["table_wise"], TableConstraints(sharding_types=["row_wise"]), r"sharding_types=\['row_wise'\]"),  # conflicts with the allow-list
        (None, TableConstraints(compute_kernels=["fused_uvm"]), r"compute_kernels=\['fused_uvm'\]"),  # a CUDA-only kernel on CPU
    ],
)
def test_a_table_that_no_allowed_sharding_fits_is_named_with_its_constraint_before_planning(planner, allowed, constraint, asked):
    # TorchRec's enumerator raised a RuntimeError ("No available sharding type and compute kernel combination
    # ... search above for warning logs") that named neither the constraint nor what the planner could use.
    config = PlanningConfig(planner=planner, sharding_types=allowed, table_constraints={"t_sparse_1": constraint})
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params(), allowed)
    pipeline = PlanningPipeline(config, sharders=sharders, topology=TOPOLOGY, compute_device="cpu")
    with pytest.raises(ValueError, match=rf"table 't_sparse_1' \(EmbeddingBagCollection\): no sharding type and compute kernel.*{asked}"):
        pipeline.run(_model())


@pytest.mark.parametrize("planner", ["torchrec", "balanced"])
def test_the_plan_report_gives_each_table_its_own_size_when_two_modules_share_a_table_name(planner):
    # A two-tower model whose towers each name their table "t": the report looked tables up by name,
    # so both rows showed the last module's rows x dim (64 x 16 twice) while 40 x 8 was sharded too.
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    model = nn.Module()
    model.user = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=40, feature_names=["u"])], device=torch.device("meta"))
    model.item = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=64, feature_names=["i"])], device=torch.device("meta"))
    report = _pipeline(PlanningConfig(planner=planner)).run(model).report
    assert sorted((t.name, t.rows, t.dim) for t in report.tables) == [("t", 40, 8), ("t", 64, 16)]
    assert "40 x 8" in report.to_table() and "64 x 16" in report.to_table()


def test_reshape_advice_follows_the_table_constraints():
    # A table that may only be data_parallel sends nothing through the all-to-all, yet the advice
    # reshaped it (a projection layer and a different model, for a "47%" saving that cannot happen),
    # and a TableConstraints(pooling_factor=...) the planner used was not used for the advice's bytes.
    dp_only = {"t_sparse_1": TableConstraints(sharding_types=["data_parallel"])}
    inputs = _pipeline(PlanningConfig(reshape_tables=True, table_constraints=dp_only)).prepare(_model())
    assert [a.table for a in inputs.reshape] == ["t_sparse_0"]
    stats = {"t_sparse_1": TableStats(pooling_factor=2.0)}  # statistics of the data-parallel table do not get in the way
    with_stats = _pipeline(PlanningConfig(reshape_tables=True, table_constraints=dp_only, table_stats=stats)).prepare(_model())
    assert [a.table for a in with_stats.reshape] == ["t_sparse_0"]
    assert _pipeline(PlanningConfig(reshape_tables=True, sharding_types=["data_parallel"])).prepare(_model()).reshape == ()
    plain = _pipeline(PlanningConfig(reshape_tables=True)).prepare(_model())
    pooled = _pipeline(
        PlanningConfig(reshape_tables=True, table_constraints={"t_sparse_0": TableConstraints(pooling_factor=20.0)})
    ).prepare(_model())
    before = {a.table: a.bytes_before for a in plain.reshape}
    assert {a.table: a.bytes_before for a in pooled.reshape}["t_sparse_0"] > before["t_sparse_0"]


class _TwoWidths(torch.nn.Module):
    """Tables of dims 12 and 16: the fp8/int8 scale block is gcd(12, 16) = 4 values."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=64, feature_names=[f"f{i}"])
                for i, dim in enumerate((12, 16))
            ],
            device=torch.device("meta"),
        )


def _qcomms_report(precision: str):
    from lightning_recsys.parallel.comms.qcomms import QCommsCodecs, QCommsConfig, resolve_qcomms

    effective = resolve_qcomms(QCommsConfig.preset(precision))
    fused = EmbeddingOptimizerConfig(name="sgd").fused_params()

    def sharders(plan=None):
        return make_sharders(fused, ["table_wise"], qcomm_codecs_registry=QCommsCodecs.build(effective, plan).registry)

    pipeline = PlanningPipeline(
        PlanningConfig(sharding_types=["table_wise"]), sharders=sharders(), topology=TOPOLOGY, compute_device="cpu",
        final_sharders=sharders,
    )
    return pipeline.run(_TwoWidths()).report


def test_the_plan_report_counts_the_bytes_the_plans_codecs_send():
    # At blocks of 4 values fp8 sends 2 bytes per value, so it runs as bf16 (the setup warns), but the
    # report was made with the planner's codecs, before the block was known: 1 byte per value plus a
    # scale per row, 30% fewer all-to-all bytes than what went on the wire.
    fp8, bf16 = _qcomms_report("fp8"), _qcomms_report("bf16")
    assert [r.a2a_bytes for r in fp8.ranks] == [r.a2a_bytes for r in bf16.ranks]
    assert fp8.comm == bf16.comm
