"""What the emulated cluster runs: the cluster's shape, the strategy configurations, and the workloads.

``CONFIGS`` are strategy settings (layout, QComms, replica sync), each a ``BenchConfig``; ``WORKLOADS`` are
the model and data every configuration trains, each a ``Workload`` (``--workload``). A configuration
or a workload is one more entry here: the runs and the report take whatever these say.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _pretrain_workload as pretrain
import _sequence_workload as sequence
from _workload import table_sizes, workload_argv

NODES, RANKS_PER_NODE = 2, 2


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the strategy; everything else (model, data, processes) is shared."""

    name: str
    label: str
    sharding_group_size: int
    layout: str = "all_to_all_optimized"
    qcomms: str = "fp32"  # a _bench_job.py --qcomms choice
    sync_every_n_steps: int = 1
    sync_rows: str = "touched"  # ReplicaSyncConfig.rows
    sync_overlap: bool = False  # ReplicaSyncConfig.overlap
    sync_precision: str = "fp32"  # ReplicaSyncConfig.precision
    sync_exchange: str = "all_reduce"  # ReplicaSyncConfig.exchange
    index_dedup: bool = False  # QCommsConfig.index_dedup (sequence tables; a no-op on pooled ones)

    @property
    def is_2d(self) -> bool:
        return self.sharding_group_size < NODES * RANKS_PER_NODE


def _touched(
    name: str, label: str, every: int, *, overlap: bool = False, precision: str = "fp32", exchange: str = "all_reduce"
) -> BenchConfig:
    return BenchConfig(
        name, label, sharding_group_size=2, sync_every_n_steps=every, sync_rows="touched", sync_overlap=overlap, sync_precision=precision,
        sync_exchange=exchange,
    )


CONFIGS: tuple[BenchConfig, ...] = (
    BenchConfig("1d_fp32", "1D FP32", sharding_group_size=4),
    BenchConfig("1d_fp8", "1D FP8", sharding_group_size=4, qcomms="fp8"),
    # TorchRec's index dedup of the sequence ids before the all-to-all: the best 1D of a sequence workload.
    BenchConfig("1d_dedup_fp32", "1D FP32, index dedup", sharding_group_size=4, index_dedup=True),
    BenchConfig("1d_dedup_fp8", "1D FP8, index dedup", sharding_group_size=4, qcomms="fp8", index_dedup=True),
    BenchConfig("2d_all_sync4", "2D whole-shard sync every 4", sharding_group_size=2, sync_every_n_steps=4, sync_rows="all"),
    _touched("2d_touched", "2D touched sync", 1),
    _touched("2d_touched_sync4", "2D touched sync every 4", 4),
    _touched("2d_touched_bf16", "2D touched sync, bf16 deltas", 1, precision="bf16"),
    _touched("2d_touched_bf16_sync4", "2D touched sync every 4, bf16 deltas", 4, precision="bf16"),
    _touched("2d_touched_overlap", "2D touched sync, overlapped", 1, overlap=True),
    _touched("2d_touched_overlap_sync4", "2D touched sync every 4, overlapped", 4, overlap=True),
    _touched("2d_touched_overlap_bf16", "2D touched sync, overlapped, bf16 deltas", 1, overlap=True, precision="bf16"),
    _touched("2d_touched_overlap_bf16_sync4", "2D touched sync every 4, overlapped, bf16 deltas", 4, overlap=True, precision="bf16"),
    # Each replica all-gathers its own touched rows' changes (no union agreement), bf16 or fp8 with a scale per row.
    _touched("2d_gather_overlap_bf16_sync4", "2D touched all-gather every 4, overlapped, bf16 deltas", 4, overlap=True,
             precision="bf16", exchange="all_gather"),
    _touched("2d_gather_overlap_fp8_sync4", "2D touched all-gather every 4, overlapped, fp8 deltas", 4, overlap=True,
             precision="fp8", exchange="all_gather"),
    # Every 16 kept quality on both quality benchmarks (docs/performance.md, Replica sync quality). Off by default: it needs --steps and
    # --warmup-steps that are multiples of 16 (e.g. 48 and 16), which doubles every run.
    _touched("2d_touched_overlap_bf16_sync16", "2D touched sync every 16, overlapped, bf16 deltas", 16, overlap=True, precision="bf16"),
    _touched("2d_gather_overlap_fp8_sync16", "2D touched all-gather every 16, overlapped, fp8 deltas", 16, overlap=True,
             precision="fp8", exchange="all_gather"),
    # 2D all-to-all optimized keeps the embedding all-to-all inside a node: QComms there only adds codec time.
    BenchConfig("2d_ar_touched", "2D all-reduce opt., touched sync", sharding_group_size=2, layout="all_reduce_optimized"),
)


# Not run by default: whole-shard sync of these tables moves ~100 MB per rank per sync (seconds at 200 Mbit/s);
# every 16 needs longer runs (above).
DEFAULT_OFF = ("2d_all_sync4", "2d_ar_touched", "2d_touched_overlap_bf16_sync16", "2d_gather_overlap_fp8_sync16", "1d_dedup_fp32",
               "1d_dedup_fp8")  # fmt: skip


TARGET, MOONSHOT = 1.25, 1.10  # best 2D cluster step / best unshaped step of any configuration
TWO_D_TARGET = 0.7  # the sequence workload: best 2D cluster step / best 1D cluster step


def unavailable_reason(cfg: BenchConfig) -> str | None:
    """Why the installed ReplicaSyncConfig refuses ``cfg``'s sync settings (None: it accepts them)."""
    from lightning_recsys import ReplicaSyncConfig

    try:
        ReplicaSyncConfig(rows=cfg.sync_rows, every_n_steps=cfg.sync_every_n_steps, overlap=cfg.sync_overlap, precision=cfg.sync_precision,  # type: ignore[arg-type]
                          exchange=cfg.sync_exchange)  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Workload:
    """The model and data every configuration trains: what ``_bench_job.py`` is told, and how the report names it."""

    name: str
    job_argv: Callable[[argparse.Namespace], list[str]]  # _bench_job.py's model and data arguments
    describe: Callable[[argparse.Namespace], str]  # the header's "Model: ..." line
    model_json: Callable[[argparse.Namespace], dict[str, Any]]  # the JSON's "model"
    defaults: dict[str, Any] = field(default_factory=dict)  # the driver's option defaults under this workload
    default_configs: tuple[str, ...] | None = None  # None: every configuration but DEFAULT_OFF
    # The 2D configurations the cost model ranks before the run; the best joins the default ones.
    two_d_candidates: tuple[str, ...] = ()


def _dlrm_description(args: argparse.Namespace) -> str:
    return (
        f"Model: DLRM, {args.tables} tables x rows {table_sizes(args.table_rows, args.tables)} x dim {args.embedding_dim}, "
        f"table-wise, on meta; Zipf({args.zipf_exponent:g}) ids, pooling {args.pooling_factor:g}; "
        f"global batch {args.global_batch_size}; {args.warmup_steps} warm-up + {args.steps} timed steps per run."
    )


def _dlrm_json(args: argparse.Namespace) -> dict[str, Any]:
    return {"tables": args.tables, "table_rows": table_sizes(args.table_rows, args.tables), "embedding_dim": args.embedding_dim,
            "global_batch_size": args.global_batch_size, "pooling_factor": args.pooling_factor,
            "zipf_exponent": args.zipf_exponent, "sharding_type": "table_wise"}  # fmt: skip


def _sequence_argv(args: argparse.Namespace) -> list[str]:
    return [*workload_argv(args), "--workload", "sequence", *sequence.sequence_argv(args)]


def _pretrain_argv(args: argparse.Namespace) -> list[str]:
    return [*workload_argv(args), "--workload", "pretrain", *pretrain.pretrain_argv(args)]


_TWO_D_CANDIDATES = ("2d_touched_overlap", "2d_touched_overlap_sync4", "2d_touched_overlap_bf16", "2d_touched_overlap_bf16_sync4",
                     "2d_gather_overlap_bf16_sync4", "2d_gather_overlap_fp8_sync4")  # fmt: skip


WORKLOADS: dict[str, Workload] = {
    "dlrm": Workload("dlrm", job_argv=workload_argv, describe=_dlrm_description, model_json=_dlrm_json),
    # Global batch 256 of 64-item histories: one CPU step near the DLRM run's (docs/performance.md says why).
    "sequence": Workload(
        "sequence", job_argv=_sequence_argv, describe=sequence.describe, model_json=sequence.model_json,
        defaults={"global_batch_size": 256}, default_configs=("1d_fp32", "1d_dedup_fp32", "1d_dedup_fp8"),
        two_d_candidates=_TWO_D_CANDIDATES,
    ),
    # SequencePretrainer on Beauty-like sequences (_pretrain_workload.py): short histories, a shared pool of uniform negatives.
    "pretrain": Workload(
        "pretrain", job_argv=_pretrain_argv, describe=pretrain.describe, model_json=pretrain.model_json,
        defaults={"global_batch_size": 1024, "embedding_dim": 64, "items": 1_000_000, "transformer_layers": 1, "zipf_exponent": 1.05},
        default_configs=("1d_fp32", "1d_dedup_fp32", "1d_dedup_fp8"), two_d_candidates=_TWO_D_CANDIDATES,
    ),
}
DEFAULT_WORKLOAD = "dlrm"
