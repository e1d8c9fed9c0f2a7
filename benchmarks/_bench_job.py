"""One timed training job for the benchmarks: run it under torchrun on every "node".

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr ... --master-port ... \
        benchmarks/_bench_job.py --num-nodes 2 --devices 2 --sharding-group-size 4 --out result.json

Trains ``DLRMRanker`` on synthetic click logs with ``TwoDRecStrategy`` for ``--warmup-steps`` then
``--steps`` steps, and on global rank 0 writes a JSON file with the step time (warm-up excluded),
examples per second and the bytes per step of every collective from ``strategy.comm_accounting``,
split by purpose and by intra- or inter-node. The batches are generated before training
(one per step by default), so data generation does not count as step time (it is not what is being
compared).

Step time: the time between consecutive ``on_train_batch_start`` calls on rank 0. Steps are
grouped in windows of ``sync_every_n_steps`` (one replica sync each), and the reported step time is
the median over windows of the window's mean step time: a median drops the spikes a shared machine
adds, and a window keeps the periodic sync in the average instead of dropping it as an outlier.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import _pretrain_workload as pretrain
import _sequence_workload as sequence
from _workload import add_workload_arguments, table_sizes

QCOMMS_CHOICES = ("fp32", "bf16", "fp16", "fp8", "int8", "fp8_fwd_bf16_bwd")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result path (written by global rank 0)")
    parser.add_argument("--devices", type=int, default=2, help="ranks per node")
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--workload", default="dlrm", choices=["dlrm", "sequence", "pretrain"])
    add_workload_arguments(parser, table_rows="256", steps_help="timed steps after warm-up")
    sequence.add_sequence_arguments(parser)
    pretrain.add_pretrain_arguments(parser)
    parser.add_argument("--sharding-type", default="table_wise")
    add_strategy_arguments(parser)
    parser.add_argument(
        "--unique-batches", type=int, default=None,
        help="distinct pre-generated batches, cycled (default: one per step, so a sync's union is that of fresh ids, as in training)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--phase-times", action="store_true", help="also time the replica sync's phases and forward/backward per step (rank 0)"
    )
    parser.add_argument(
        "--trace-dir", default=None,
        help="write a torch.profiler trace per rank into DIR/node<N> (Lightning's PyTorchProfiler: steps 3-5 recorded)",
    )
    return parser.parse_args(argv)


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """The strategy settings a ``BenchConfig`` sets (``emulated/runs.py``'s ``strategy_arguments``)."""
    parser.add_argument("--sharding-group-size", type=int, default=None, help="default: all ranks (1D)")
    parser.add_argument("--layout", default="all_to_all_optimized", choices=["all_to_all_optimized", "all_reduce_optimized"])
    parser.add_argument("--sync-every-n-steps", type=int, default=1)
    parser.add_argument(
        "--sync-rows", default="all", choices=["all", "touched"], help="ReplicaSyncConfig.rows (default: whole shards)"
    )
    parser.add_argument(
        "--sync-overlap", action=argparse.BooleanOptionalAction, default=False, help="ReplicaSyncConfig.overlap (default: off)"
    )
    parser.add_argument("--sync-precision", default="fp32", choices=["fp32", "bf16", "fp8"], help="ReplicaSyncConfig.precision")
    parser.add_argument("--sync-exchange", default="all_reduce", choices=["all_reduce", "all_gather"], help="ReplicaSyncConfig.exchange")
    parser.add_argument(
        "--sync-average", default="auto", choices=["auto", "all_replicas", "touching_replicas"], help="ReplicaSyncConfig.average"
    )
    parser.add_argument("--qcomms", default="fp32", choices=QCOMMS_CHOICES)
    parser.add_argument(
        "--index-dedup", action=argparse.BooleanOptionalAction, default=False, help="QCommsConfig.index_dedup (sequence tables)"
    )


def replica_sync_config(args: argparse.Namespace) -> Any:
    from lightning_recsys import ReplicaSyncConfig

    return ReplicaSyncConfig(
        rows=args.sync_rows, every_n_steps=args.sync_every_n_steps, overlap=args.sync_overlap, precision=args.sync_precision,
        exchange=args.sync_exchange, average=args.sync_average,
    )


def qcomms_setting(name: str, index_dedup: bool = False) -> Any:
    from lightning_recsys import QCommsConfig

    if name == "fp8_fwd_bf16_bwd":
        return QCommsConfig(forward="fp8", backward="bf16", index_dedup=index_dedup)
    if index_dedup:
        return QCommsConfig(forward=name, backward=name, index_dedup=True)  # type: ignore[arg-type]
    return name


def _cached_datamodule(config: Any, unique: int, module: type | None = None) -> Any:
    """A synthetic data module (default SyntheticClickLogDataModule) whose train split cycles ``unique``
    pre-generated global batches."""
    from torch.utils.data import IterableDataset

    from lightning_recsys.data import SyntheticClickLogDataModule
    from lightning_recsys.data.synthetic.click_log import SyntheticClickLogDataset

    base: Any = module or SyntheticClickLogDataModule

    class _Cycled(IterableDataset):
        def __init__(self, inner: SyntheticClickLogDataset) -> None:
            self.num_batches = inner.num_batches
            self.batches = [b for _, b in zip(range(unique), iter(inner))]

        def __len__(self) -> int:
            return self.num_batches

        def __iter__(self) -> Iterator[Any]:
            for index in range(self.num_batches):
                yield self.batches[index % len(self.batches)]

    class _CachedDataModule(base):  # type: ignore[valid-type,misc]
        def _dataset(self, split: Any, rank: int, world_size: int) -> Any:
            inner = super()._dataset(split, rank, world_size)
            return _Cycled(inner) if split == "train" else inner

    return _CachedDataModule.from_config(config)


def _dlrm_job(args: argparse.Namespace, total_steps: int) -> tuple[Any, Any, Any]:
    """The DLRM workload's data module, model and planning config."""
    from lightning_recsys import PlanningConfig
    from lightning_recsys.data import SyntheticClickLogConfig
    from lightning_recsys.models import DLRMRanker

    data = _cached_datamodule(
        SyntheticClickLogConfig(
            table_sizes=table_sizes(args.table_rows, args.tables),
            pooling_factors=args.pooling_factor,
            zipf_exponent=args.zipf_exponent,
            global_batch_size=args.global_batch_size,
            train_batches=total_steps + 1,  # +1: the last step's end is timed by the next start
            val_batches=0,
            seed=args.seed,
        ),
        args.unique_batches or total_steps + 1,
    )
    model = DLRMRanker(
        table_sizes=data.config.table_sizes,
        num_dense_features=data.config.num_dense_features,
        embedding_dim=args.embedding_dim,
        dense_arch_layer_sizes=[64, args.embedding_dim],
        over_arch_layer_sizes=[64, 32, 1],
        embedding_device="meta",
        dense_optimizer="sgd",
    )
    return data, model, PlanningConfig(sharding_types=[args.sharding_type])


def _sequence_job(args: argparse.Namespace, total_steps: int) -> tuple[Any, Any, Any]:
    """The sequence workload's data module, model and planning config (``_sequence_workload.py``)."""
    from lightning_recsys.data import SyntheticSequenceDataModule

    sequence.check_sequence_arguments(args)
    config = sequence.data_config(args, total_steps + 1)  # +1: the last step's end is timed by the next start
    data = _cached_datamodule(config, args.unique_batches or total_steps + 1, SyntheticSequenceDataModule)
    return data, sequence.model(args, config), sequence.planning(config)


def _pretrain_job(args: argparse.Namespace, total_steps: int) -> tuple[Any, Any, Any]:
    """The pretraining workload's data module, model and planning config (``_pretrain_workload.py``)."""
    pretrain.check_pretrain_arguments(args)
    return pretrain.datamodule(args), pretrain.model(args), pretrain.planning()


_JOBS = {"dlrm": _dlrm_job, "sequence": _sequence_job, "pretrain": _pretrain_job}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    # 4 ranks share few cores: one intra-op thread each keeps them from fighting over them.
    torch.set_num_threads(1)

    from lightning_recsys import EmbeddingOptimizerConfig, TwoDRecStrategy

    # Built first: a setting the installed ReplicaSyncConfig refuses fails before any process group starts.
    replica_sync = replica_sync_config(args)
    world = args.devices * args.num_nodes
    group_size = args.sharding_group_size or world
    if args.warmup_steps % args.sync_every_n_steps or args.steps % args.sync_every_n_steps:
        raise ValueError(
            f"--warmup-steps={args.warmup_steps} and --steps={args.steps} must be multiples of "
            f"--sync-every-n-steps={args.sync_every_n_steps}, so the timed window holds whole sync periods."
        )
    total_steps = args.warmup_steps + args.steps
    pl.seed_everything(args.seed, verbose=False)
    data, model, planning = _JOBS[args.workload](args, total_steps)
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.05),
        planning=planning,
        sharding_group_size=group_size,
        layout=args.layout,
        replica_sync=replica_sync,
        qcomms=qcomms_setting(args.qcomms, args.index_dedup),
        process_group_timeout=120.0,  # a stuck peer fails the run instead of hanging it
    )
    phases = _PhaseTimer() if args.phase_times else None
    timer = _StepTimer(strategy, warmup=args.warmup_steps, steps=args.steps, phases=phases)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=total_steps + 1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[timer],
        profiler=_profiler(args.trace_dir),
    )
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return None
    result = timer.result(args, strategy, world)
    if args.workload == "sequence":  # what index dedup keeps of rank 0's ids, over the timed steps' batches
        timed = [data.log.global_batch("train", i) for i in range(args.warmup_steps, total_steps)]
        result["unique_id_fraction_rank0"] = sequence.unique_fraction(timed, 0, world)
    if args.workload == "pretrain":  # the same for the pretrainer's item table (history, targets, negatives)
        result["unique_id_fraction_rank0"] = pretrain.unique_fraction(pretrain.training_batches(args, world, total_steps, data)[0][args.warmup_steps:])
        result["sequence_all_to_all_by_feature_rank0"] = timer.lookup_split()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"[bench_job] step {result['step_time_s'] * 1e3:.1f} ms, {result['examples_per_s']:.0f} examples/s -> {args.out}")
    print(strategy.comm_accounting.summary())
    if "phase_ms_per_step" in result:
        print("[bench_job] ms per step: " + ", ".join(f"{k} {v:.1f}" for k, v in result["phase_ms_per_step"].items()))
    return result


def _profiler(trace_dir: str | None) -> Any:
    """Lightning's PyTorchProfiler writing this node's ranks' Chrome traces (None: no profiler)."""
    if trace_dir is None:
        return None
    from lightning.pytorch.profilers import PyTorchProfiler

    return PyTorchProfiler(dirpath=Path(trace_dir) / f"node{os.environ.get('GROUP_RANK', '0')}")  # torchrun's node rank


class _StepTimer(pl.Callback):
    """Step start times and per-step traffic on this rank."""

    def __init__(self, strategy: Any, *, warmup: int, steps: int, phases: _PhaseTimer | None = None) -> None:
        self.strategy, self.warmup, self.steps, self.phases = strategy, warmup, steps, phases
        self.starts: list[float] = []
        self.wall_starts: list[float] = []  # time.time() of each start, to match other processes' samples
        self.traffic: list[dict[Any, Any]] = []
        self.lookups: list[dict[str, dict[str, tuple[int, int]]]] = []  # the sequence all-to-all by feature, per step
        self.syncs: list[tuple[int, Any]] = []  # (step index, SyncStats) of every replica sync after a step
        self._last_stats: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.wall_starts.append(time.time())
        if self.phases is not None:
            self.phases.new_step(self.starts[-1])

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.phases is not None:
            self.phases.mark("forward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.phases is not None:
            self.phases.mark("backward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The strategy closes the step's accounting in optimizer_step, before this hook.
        self.traffic.append(dict(self.strategy.comm_accounting.last_step))
        self.lookups.append(self.strategy.comm_accounting.lookup_split())
        stats = self.strategy.replica_sync_stats  # a new object per sync
        if stats is not None and stats is not self._last_stats:
            self.syncs.append((len(self.traffic) - 1, stats))
            self._last_stats = stats

    def result(self, args: argparse.Namespace, strategy: Any, world: int) -> dict[str, Any]:
        w, n, k = self.warmup, self.steps, args.sync_every_n_steps
        if len(self.starts) < w + n + 1:
            raise RuntimeError(f"only {len(self.starts)} steps ran; expected {w + n + 1}")
        step_times = [b - a for a, b in zip(self.starts[w : w + n], self.starts[w + 1 : w + n + 1])]
        windows = [statistics.fmean(step_times[i : i + k]) for i in range(0, n, k)]
        step = statistics.median(windows)
        rows: dict[tuple[str, str, str, bool], dict[str, float]] = {}
        for table in self.traffic[w : w + n]:
            for key, t in table.items():
                row = rows.setdefault(
                    (key.purpose, key.op, key.group, key.spans_nodes), {"calls": 0.0, "payload_bytes": 0.0, "inter_node_bytes": 0.0}
                )
                row["calls"] += t.calls / n
                row["payload_bytes"] += t.payload_bytes / n
                row["inter_node_bytes"] += t.inter_node_bytes / n
        topology = strategy.topology
        traffic = [
            {"purpose": p, "op": o, "group": g, "spans_nodes": s, "group_size": _group_size(topology, g, world), **v}
            for (p, o, g, s), v in sorted(rows.items())
        ]
        payload = sum(r["payload_bytes"] for r in traffic)
        inter = sum(r["inter_node_bytes"] for r in traffic)
        return {
            "config": {k2: v for k2, v in vars(args).items() if k2 != "out"},
            "world_size": world,
            "ranks_per_node": args.devices,
            "sharding_groups": topology.sharding_groups(),
            "replica_groups": topology.replica_groups(),
            "plan": _plan_summary(strategy),
            "step_time_s": step,
            "step_time_mean_s": statistics.fmean(step_times),
            "step_time_min_s": min(step_times),
            "step_times_s": step_times,
            "timed_window_unix_s": [self.wall_starts[w], self.wall_starts[w + n]],
            "examples_per_s": args.global_batch_size / step,
            "bytes_per_step_rank0": {"intra_node": payload - inter, "inter_node": inter, "total": payload},
            "traffic_per_step_rank0": traffic,
            "table_sizes": table_sizes(args.table_rows, args.tables),
            "rank0_tables": _rank0_tables(strategy),
            "replica_sync": self._sync_summary(),
            **({"phase_ms_per_step": self.phases.summary(w, n),
                "phase_ms_by_step_in_interval": self.phases.by_step_in_interval(w, n, k)} if self.phases is not None else {}),
        }

    def lookup_split(self) -> dict[str, dict[str, dict[str, float]]]:
        """Rank 0's sequence all-to-all bytes by feature and direction (payload, inter-node), mean over the timed steps."""
        timed = self.lookups[self.warmup : self.warmup + self.steps]
        out: dict[str, dict[str, dict[str, float]]] = {}
        for step in timed:
            for feature, parts in step.items():
                for direction, (payload, inter) in parts.items():
                    cell = out.setdefault(feature, {}).setdefault(direction, {"payload": 0.0, "inter_node": 0.0})
                    cell["payload"] += payload / len(timed)
                    cell["inter_node"] += inter / len(timed)
        return out

    def _sync_summary(self) -> dict[str, Any] | None:
        """Rank 0's replica syncs that ran after timed steps: rows per sync, touched fraction, bytes."""
        timed = [s for step, s in self.syncs if self.warmup <= step < self.warmup + self.steps]
        if not timed:
            return None
        return {
            "syncs": len(timed),
            "rows_per_sync": statistics.fmean(s.rows_synced for s in timed),
            "rows_total": timed[0].rows_total,
            "touched_fraction": statistics.fmean(s.touched_fraction for s in timed),
            "payload_bytes_per_sync": statistics.fmean(s.payload_bytes for s in timed),
            "union": sorted({s.union for s in timed}),
        }


class _PhaseTimer:
    """Per step on this rank: time in the replica sync's phases (wrapped methods) and in forward / backward.

    ``forward``: batch start to ``on_before_backward``; ``backward``: to ``on_after_backward`` (the
    fused embedding update runs in it); the sync's phases nest in the optimizer step that follows.
    """

    WRAPPED = (
        ("track", "lightning_recsys.parallel.sync.touched_rows", "RowTracker", "_record"),
        ("agree", "lightning_recsys.parallel.sync.replica_sync", "ReplicaSynchronizer", "_union"),
        ("gather", "lightning_recsys.parallel.sync.replica_sync", "ReplicaSynchronizer", "_table_items"),
        ("launch", "lightning_recsys.parallel.sync.sync_deltas", "InFlightSync", "__init__"),
        ("apply", "lightning_recsys.parallel.sync.sync_deltas", "InFlightSync", "apply"),
        ("gather_launch", "lightning_recsys.parallel.sync.sync_gather", "GatheredSync", "__init__"),
        ("gather_apply", "lightning_recsys.parallel.sync.sync_gather", "GatheredSync", "apply"),
        ("gather_wait", "lightning_recsys.parallel.sync.sync_gather", "GatheredSync", "wait"),
        ("gather_write", "lightning_recsys.parallel.sync.sync_gather", "", "_write_average"),
        ("sync_total", "lightning_recsys.parallel.sync.replica_sync", "ReplicaSynchronizer", "step_ended"),
    )

    def __init__(self) -> None:
        import importlib

        self.steps: list[dict[str, float]] = []
        self._last = 0.0
        for phase, module, cls_name, method in self.WRAPPED:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls_name, None) if cls_name else owner  # "": a module-level function
            if owner is not None and hasattr(owner, method):  # phases a version lacks are not timed
                setattr(owner, method, self._timed(phase, getattr(owner, method)))

    def _timed(self, phase: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.steps:
                    self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + time.perf_counter() - start

        return timed

    def new_step(self, now: float) -> None:
        self.steps.append({})
        self._last = now

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        if self.steps:
            self.steps[-1][phase] = now - self._last
        self._last = now

    def by_step_in_interval(self, warmup: int, steps: int, interval: int) -> list[dict[str, float]]:
        """Forward, backward and sync ms per step at each position in the sync interval (the last position
        launches the sync; with overlap the others send its pieces): where a sync's traffic or CPU lands."""
        timed = self.steps[warmup : warmup + steps]
        return [
            {k: 1e3 * sum(s.get(k, 0.0) for s in timed[pos::interval]) / max(1, len(timed[pos::interval]))
             for k in ("forward", "backward", "sync_total")}
            for pos in range(interval)
        ]

    def summary(self, warmup: int, steps: int) -> dict[str, float]:
        timed = self.steps[warmup : warmup + steps]
        names = sorted({k for s in timed for k in s})
        return {k: 1e3 * sum(s.get(k, 0.0) for s in timed) / max(1, len(timed)) for k in names}


def _group_size(topology: Any, group: str, world: int) -> int:
    if group == "world":
        return world
    if group == "shard":
        return topology.sharding_group_size
    if group == "replicate":
        return topology.num_replicas
    return len(group.removeprefix("ranks").split(","))


def _rank0_tables(strategy: Any) -> list[str] | None:
    """Tables with a shard on rank 0 (plan ranks are sharding-group-local; rank 0 is local rank 0 in either layout)."""
    try:
        plan = strategy.sharded_model.plan
        return sorted(t for module_plan in plan.plan.values() for t, sharding in module_plan.items() if 0 in (sharding.ranks or []))
    except Exception:  # noqa: BLE001 - informational
        return None


def _plan_summary(strategy: Any) -> dict[str, str]:
    """Table -> sharding type, best effort (for the record; the benchmark does not depend on it)."""
    try:
        plan = strategy.sharded_model.plan
        out = {}
        for module_plan in plan.plan.values():
            for table, sharding in module_plan.items():
                out[table] = f"{sharding.sharding_type} ranks={sharding.ranks}"
        return out
    except Exception as exc:  # noqa: BLE001 - the plan is informational only
        return {"unavailable": repr(exc)}


if __name__ == "__main__":
    # Quiet Lightning's banners on the non-zero ranks; errors still print.
    if os.environ.get("RANK", "0") != "0":
        import logging

        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    main()
