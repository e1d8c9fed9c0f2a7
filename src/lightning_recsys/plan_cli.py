"""``lightning-recsys plan``: print the sharding plan report of a ``fit`` config, without training.

    lightning-recsys plan --config examples/configs/synthetic_dlrm.yaml --world-size 16 --sharding-group-size 8
    lightning-recsys plan --config examples/configs/criteo_dlrm.yaml --world-size 8 --sharding-group-size 8 \
        --profile-batches 0 --compare --json plan.json

Reads the same YAML as ``lightning-recsys fit --config`` (extra ``--section.key value`` overrides are
passed on to it), builds the model and DataModule on the CPU (the Trainer is built with one CPU
device, so no process group starts and no GPU is touched), profiles a few training batches for
the traffic statistics, and plans one sharding group with ``BalancedPlanner`` (or TorchRec's
default planner). The plan is made for the config's accelerator: ``gpu``/``cuda`` plans for CUDA
ranks without needing one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import PlannerError

from lightning_recsys.parallel import make_sharders, supported_sharding_types
from lightning_recsys.parallel.qcomms import QCommsCodecs, QCommsConfig, resolve_qcomms
from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner import (
    BalancedPlanner,
    CommCosts,
    PlanReport,
    TableStats,
    apply_reshape,
    build_plan_report,
    embedding_tables,
    suggest_reshape,
    torchrec_constraints,
)
from lightning_recsys.planner.torchrec_planner import make_topology, quiet_torchrec_planner
from lightning_recsys.planner.stats import resolve_table_stats

_GPU_ACCELERATORS = {"gpu", "cuda"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-recsys plan",
        description="Print the sharding plan report for a fit config (no process group, no GPU work).",
        epilog="Other --section.key value arguments override the config, as with `lightning-recsys fit`.",
    )
    parser.add_argument("--config", required=True, type=Path, help="the YAML config of `lightning-recsys fit`")
    parser.add_argument("--world-size", required=True, type=int, help="total ranks of the job")
    parser.add_argument(
        "--sharding-group-size", type=int, default=None, help="ranks per sharding group (default: the config's, else the world size)"
    )
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: the config's trainer.devices, else the group size")
    parser.add_argument("--planner", choices=("balanced", "default"), default="balanced", help="BalancedPlanner or TorchRec's default")
    parser.add_argument("--compare", action="store_true", help="also plan with the other planner and print both")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per rank per step (default: profiled batch / world size)")
    parser.add_argument("--profile-batches", type=int, default=8, help="training batches to profile for traffic stats; 0: assume")
    parser.add_argument("--compute-device", choices=("cpu", "cuda"), default=None, help="default: from trainer.accelerator")
    parser.add_argument("--memory-per-rank-gib", type=float, default=None, help="HBM (cuda) or DDR (cpu) per rank, in GiB")
    parser.add_argument("--hash-partitions", nargs="*", default=[], metavar="TABLE=P", help="tables hashed into P partitions")
    parser.add_argument("--reshape", action="store_true", help="apply bandwidth-aware reshaping (dim/2, rows*2) before planning")
    parser.add_argument("--json", type=Path, default=None, help="also write the report(s) as JSON here")
    return parser


def plan_main(argv: list[str]) -> int:
    """Entry point of ``lightning-recsys plan``; returns the process exit code (0 ok, 1 planning failed)."""
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        hash_partitions = _parse_partitions(args.hash_partitions)
    except ValueError as err:
        parser.error(str(err))
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchrec")
    try:
        reports = _plan(args, overrides, hash_partitions)
    except (PlannerError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"lightning-recsys plan: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    for report in reports:
        print(report.to_table())
        print()
    if len(reports) == 2:
        print(_comparison(reports))
    if args.json is not None:
        payload: Any = reports[0].to_json() if len(reports) == 1 else [r.to_json() for r in reports]
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"JSON: {args.json}")
    return 0


def _parse_partitions(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise ValueError(f"--hash-partitions {item!r} must look like TABLE=P with an integer P, e.g. t_sparse_0=64.")
        out[name] = int(value)
    return out


def _plan(args: argparse.Namespace, overrides: list[str], hash_partitions: dict[str, int]) -> list[PlanReport]:
    from lightning_recsys.cli import build_cli  # Lightning: CLI glue only

    raw = yaml.safe_load(args.config.read_text()) or {}
    trainer_cfg: Mapping[str, Any] = raw.get("trainer") or {}
    accelerator = str(trainer_cfg.get("accelerator", "cpu")).lower()
    compute_device = args.compute_device or ("cuda" if accelerator in _GPU_ACCELERATORS else "cpu")
    config_devices = trainer_cfg.get("devices")
    # One CPU device: building the Trainer must not start a process group or touch a GPU.
    cli_args = ["--config", str(args.config), *overrides, "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1"]
    with _quiet_lightning():
        cli = build_cli(cli_args, run=False)
    model: nn.Module = cli.model
    strategy = cli.trainer.strategy
    group = args.sharding_group_size or getattr(strategy, "_sharding_group_size", None) or args.world_size
    per_node = args.ranks_per_node or (config_devices if isinstance(config_devices, int) else None) or group
    topology = ParallelTopology(world_size=args.world_size, sharding_group_size=group, ranks_per_node=min(per_node, args.world_size))
    local = topology.sharding_group_ranks_per_node()

    qcomms = getattr(strategy, "qcomms_config", None) or QCommsConfig()
    codecs = QCommsCodecs.build(resolve_qcomms(qcomms))
    allowed = getattr(strategy, "_sharding_types", None) or supported_sharding_types(compute_device, two_d=not topology.is_1d)
    optimizer = getattr(strategy, "embedding_optimizer_config", None)
    fused = optimizer.fused_params() if optimizer is not None else {}
    sharders = make_sharders(fused, allowed, qcomm_codecs_registry=codecs.registry)
    table_constraints = dict(getattr(strategy, "_table_constraints", None) or {})

    tables = embedding_tables(model)
    defaults = {n: c.pooling_factor for n, c in table_constraints.items() if c.pooling_factor is not None}
    if not tables:
        raise ValueError(f"the model of {args.config} has no EmbeddingBagCollection/EmbeddingCollection to shard.")
    stats: dict[str, TableStats] | None = None
    batch_size = args.batch_size
    if args.profile_batches > 0:
        try:
            profile = BalancedPlanner.profile(cli.datamodule, batches=args.profile_batches)
        except Exception as err:
            raise ValueError(f"profiling the DataModule failed ({type(err).__name__}: {err}); pass --profile-batches 0 to plan without it.") from err
        stats, _ = resolve_table_stats(tables, profile, defaults)
        # The built-in DataModules yield whole global batches when no Trainer is attached.
        batch_size = batch_size or max(1, profile.examples // profile.batches // args.world_size)
    batch_size = batch_size or 512

    comm = CommCosts.from_sharders(sharders)
    advice = []
    if args.reshape:
        advice = suggest_reshape(tables, stats=stats, batch_size=batch_size, sharding_group_size=group, comm_costs=comm)
        apply_reshape(model, advice)  # interleaved ids keep each table's row-block shares valid

    memory = int(args.memory_per_rank_gib * (1 << 30)) if args.memory_per_rank_gib else None
    order = [args.planner] + ([{"balanced": "default", "default": "balanced"}[args.planner]] if args.compare else [])
    reports = []
    for name in order:
        if name == "balanced":
            planner = BalancedPlanner(
                sharding_group_size=group,
                local_world_size=local,
                compute_device=compute_device,
                batch_size=batch_size,
                stats=stats,
                constraints=table_constraints,
                hash_partitions=hash_partitions,
                comm_costs=comm,
                memory_per_rank=memory,
            )
            plan = planner.plan(model, sharders)
            label = "BalancedPlanner"
        else:
            resolved, _ = resolve_table_stats(embedding_tables(model), stats, defaults)
            default = EmbeddingShardingPlanner(
                topology=make_topology(group, local, compute_device, memory),
                batch_size=batch_size,
                constraints=torchrec_constraints(
                    embedding_tables(model), stats=resolved, table_constraints=table_constraints, hash_partitions=hash_partitions
                ),
                stats=[],
                debug=False,
            )
            with quiet_torchrec_planner():
                plan = default.plan(model, sharders)
            label = "TorchRec EmbeddingShardingPlanner"
        label += f"; {_describe(topology)}"
        reports.append(
            build_plan_report(
                plan,
                model,
                sharders,
                sharding_group_size=group,
                local_world_size=local,
                compute_device=compute_device,
                batch_size=batch_size,
                stats=stats,
                table_constraints=table_constraints,
                hash_partitions=hash_partitions,
                comm_costs=comm,
                planner=label,
                reshape=advice,
            )
        )
    return reports


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Hide the Trainer's start-up chatter, and the plan command's own argv from LightningCLI."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")]
    levels = [logger.level for logger in loggers]
    argv = sys.argv
    sys.argv = argv[:1]  # LightningCLI warns when both args= and a command line are present
    try:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        yield
    finally:
        sys.argv = argv
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _describe(topology: ParallelTopology) -> str:
    if topology.is_1d:
        return f"1D over {topology.world_size} ranks"
    return f"2D: {topology.num_replicas} replicas of sharding groups of {topology.sharding_group_size} ranks"


def _comparison(reports: list[PlanReport]) -> str:
    lines = ["max/mean per rank     " + "  ".join(f"{r.planner.split(';')[0]:>34}" for r in reports)]
    for metric in ("storage_bytes", "lookups", "a2a_bytes", "step_time_ms"):
        lines.append(f"{metric:<22}" + "  ".join(f"{r.imbalance[metric].ratio:>34.3f}" for r in reports))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
