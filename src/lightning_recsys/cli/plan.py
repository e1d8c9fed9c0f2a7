"""``lightning-recsys plan``: the sharding plan report that training with a config logs at setup, without training.

    lightning-recsys plan --config examples/configs/synthetic_dlrm.yaml
    lightning-recsys plan --config examples/configs/two_node_2d_fp8.yaml --planner balanced --compare --json plan.json
    lightning-recsys plan --config examples/configs/criteo_dlrm.yaml --world-size 64 --ranks-per-node 8 \
        --data.train_paths "[day_0.gz]"

It reads the same YAML as ``lightning-recsys fit --config`` (extra ``--section.key value``
arguments override it, as with ``fit``), builds the model, DataModule, Trainer and strategy as
training does, and runs the planning pipeline training runs (``lightning_recsys.planner.pipeline``)
with the strategy's planner settings, as rank 0 of the job the config describes: its world size,
ranks per node, sharding group size, layout and accelerator (a ``gpu`` config plans for CUDA
ranks without needing one). The Trainer is built on CPU devices and never launched: no process
group starts and no GPU is touched. Without options it prints the report training logs; the
options plan other shapes or settings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torchrec.distributed.planner.types import PlannerError

from lightning_recsys.cli.trainer import build_cli
from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner import PlanReport
from lightning_recsys.planner.config import PLANNERS
from lightning_recsys.planner.cost import advise_from_report, parse_cluster
from lightning_recsys.planner.pipeline import PlanningPipeline
from lightning_recsys.strategies import TwoDRecStrategy
from lightning_recsys.strategies.planning import planning_sharders, planning_topology

_GPU_ACCELERATORS = {"gpu", "cuda"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-recsys plan",
        description="Print the sharding plan report that training with a fit config logs at setup (no process group, no GPU work).",
        epilog="Other --section.key value arguments override the config, as with `lightning-recsys fit`. "
        "Every option defaults to what the config says.",
    )
    parser.add_argument("--config", required=True, type=Path, help="the YAML config of `lightning-recsys fit`")
    parser.add_argument("--world-size", type=int, default=None, help="total ranks (default: trainer.devices x trainer.num_nodes)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: trainer.devices")
    parser.add_argument("--sharding-group-size", type=int, default=None, help="default: the strategy's, else the ranks per node")
    parser.add_argument("--planner", choices=PLANNERS, default=None, help="default: the strategy's planner")
    parser.add_argument("--compare", action="store_true", help="also plan with the other planner and print both")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per rank per step (default: profiled, else 512)")
    parser.add_argument("--profile-batches", type=int, default=None, help="training batches to profile (default: the strategy's)")
    parser.add_argument("--compute-device", choices=("cpu", "cuda"), default=None, help="default: from trainer.accelerator")
    parser.add_argument("--memory-per-rank-gib", type=float, default=None, help="HBM (cuda) or DDR (cpu) per rank, in GiB")
    parser.add_argument(
        "--hash-partitions", nargs="*", default=None, metavar="TABLE=P", help="tables hashed into P partitions (default: the strategy's)"
    )
    parser.add_argument(
        "--reshape", action=argparse.BooleanOptionalAction, default=None, help="bandwidth-aware reshaping (default: the strategy's)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report(s) as JSON here")
    parser.add_argument(
        "--cluster", default=None, metavar="NODESxGPUS[@GBIT]", help="also print the cost model's layout advice for this cluster, e.g. 8x8"
    )
    parser.add_argument("--compute-ms", type=float, default=None, help="with --cluster: the model's compute time per step on one GPU")
    return parser


def plan_main(argv: list[str]) -> int:
    """Entry point of ``lightning-recsys plan``; returns the process exit code (0 ok, 1 planning failed)."""
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        _check_options(args)
        hash_partitions = None if args.hash_partitions is None else _parse_partitions(args.hash_partitions)
        if args.cluster is not None:
            parse_cluster(args.cluster)  # a bad value fails before planning
    except ValueError as err:
        parser.error(str(err))
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchrec")
    try:
        topology, reports, model = _plan(args, overrides, hash_partitions)
    except (PlannerError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"lightning-recsys plan: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(topology.describe())
    for report in reports:
        print(report.to_table())
        print()
    if len(reports) == 2:
        print(_comparison(reports))
    if args.cluster is not None:
        try:
            print("\n".join(advise_from_report(reports[0], model, args.cluster, args.compute_ms)))
        except ValueError as err:
            print(f"lightning-recsys plan: {err}", file=sys.stderr)
            return 1
    if args.json is not None:
        payload: Any = reports[0].to_json() if len(reports) == 1 else [r.to_json() for r in reports]
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"JSON: {args.json}")
    return 0


# Options that must be positive when given (None: not given, the config's value is used).
_POSITIVE_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("world_size", "--world-size", "total ranks"),
    ("ranks_per_node", "--ranks-per-node", "ranks per node"),
    ("sharding_group_size", "--sharding-group-size", "ranks per sharding group"),
    ("batch_size", "--batch-size", "examples per rank per step"),
    ("memory_per_rank_gib", "--memory-per-rank-gib", "memory per rank in GiB"),
    ("compute_ms", "--compute-ms", "the model's compute time per step on one GPU"),
)


def _check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot describe a job, before any planning (0 is not "unset")."""
    for attr, flag, meaning in _POSITIVE_OPTIONS:
        value = getattr(args, attr)
        if value is not None and not value > 0:
            raise ValueError(f"{flag} {value} must be > 0 ({meaning}); leave it out to use the config's value.")
    if args.profile_batches is not None and args.profile_batches < 0:
        raise ValueError(f"--profile-batches {args.profile_batches} must be >= 0 (0 turns profiling off).")
    if args.compute_ms is not None and args.cluster is None:
        raise ValueError(f"--compute-ms {args.compute_ms} is only used with --cluster NODESxGPUS; add --cluster or leave it out.")
    if args.json is not None and not args.json.parent.is_dir():
        raise ValueError(f"--json {args.json}: the directory {args.json.parent} does not exist; create it or pick another path.")


def _parse_partitions(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit():
            raise ValueError(f"--hash-partitions {item!r} must look like TABLE=P with an integer P, e.g. t_sparse_0=64.")
        out[name] = int(value)
    return out


def _plan(
    args: argparse.Namespace, overrides: list[str], hash_partitions: dict[str, int] | None
) -> tuple[ParallelTopology, list[PlanReport], Any]:
    trainer_cfg = _trainer_settings(args.config, overrides)
    ranks_per_node = args.ranks_per_node or _positive_int(trainer_cfg.get("devices"))
    if ranks_per_node is None:
        raise ValueError(f"trainer.devices={trainer_cfg.get('devices')!r} is not a number of ranks; pass --ranks-per-node.")
    world_size = args.world_size or ranks_per_node * (_positive_int(trainer_cfg.get("num_nodes", 1)) or 1)
    if world_size % ranks_per_node:
        raise ValueError(f"--world-size {world_size} is not a whole number of nodes of {ranks_per_node} ranks (--ranks-per-node).")
    accelerator = str(trainer_cfg.get("accelerator", "cpu")).lower()
    compute_device = args.compute_device or ("cuda" if accelerator in _GPU_ACCELERATORS else "cpu")

    # The job's shape on CPU devices: the DataModule then yields rank 0's batches, as in training.
    shape = ["--trainer.accelerator", "cpu", "--trainer.devices", str(ranks_per_node), "--trainer.num_nodes", str(world_size // ranks_per_node)]
    with _quiet_lightning():
        cli = build_cli(["--config", str(args.config), *overrides, *shape], run=False)
    strategy = cli.trainer.strategy
    if not isinstance(strategy, TwoDRecStrategy):
        raise ValueError(f"{args.config} trains with {type(strategy).__name__}; `lightning-recsys plan` plans TwoDRecStrategy configs.")

    settings: dict[str, Any] = {"planner": args.planner, "profile_batches": args.profile_batches, "reshape_tables": args.reshape}
    if hash_partitions is not None:
        settings["hash_partitions"] = hash_partitions
    config = dataclasses.replace(strategy.planning, **{k: v for k, v in settings.items() if v is not None})
    topology = planning_topology(
        strategy, world_size=world_size, ranks_per_node=ranks_per_node, sharding_group_size=args.sharding_group_size
    )
    sharders, _ = planning_sharders(strategy, compute_device=compute_device, topology=topology)
    memory = int(args.memory_per_rank_gib * (1 << 30)) if args.memory_per_rank_gib is not None else None

    def final_sharders(plan: Any) -> list[Any]:
        """DMP's sharders for the plan, as training builds them; the planner's where this machine cannot
        build them (FBGEMM's kernels for a CUDA job): the report then counts fp8/int8 scales per row."""
        try:
            return planning_sharders(strategy, compute_device=compute_device, topology=topology, plan=plan, device=torch.device(compute_device))[0]
        except ValueError:
            return sharders

    pipeline = PlanningPipeline(
        config, sharders=sharders, topology=topology, compute_device=compute_device, memory_per_rank=memory, final_sharders=final_sharders
    )

    datamodule = cli.datamodule
    if datamodule is not None:
        datamodule.trainer = cli.trainer  # as Trainer.fit attaches it: rank 0 of world_size ranks
    inputs = pipeline.prepare(cli.model, datamodule, setup_datamodule=True, batch_size=args.batch_size)
    order = [config.planner] + ([p for p in PLANNERS if p != config.planner] if args.compare else [])
    reports = [pipeline.plan(cli.model, inputs, planner=name).report for name in order]
    return topology, [r for r in reports if r is not None], cli.model


def _trainer_settings(config: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """``trainer.accelerator``/``devices``/``num_nodes`` as the config file and the ``--trainer.X`` overrides give them."""
    raw = yaml.safe_load(config.read_text()) or {}
    settings: dict[str, Any] = dict(raw.get("trainer") or {}) if isinstance(raw, Mapping) else {}
    items = list(overrides)
    for i, item in enumerate(items):
        for key in ("accelerator", "devices", "num_nodes"):
            flag = f"--trainer.{key}"
            if item == flag and i + 1 < len(items):
                settings[key] = yaml.safe_load(items[i + 1])
            elif item.startswith(flag + "="):
                settings[key] = yaml.safe_load(item[len(flag) + 1 :])
    return settings


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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


def _comparison(reports: list[PlanReport]) -> str:
    lines = ["max/mean per rank     " + "  ".join(f"{r.planner:>34}" for r in reports)]
    for metric in ("storage_bytes", "lookups", "a2a_bytes", "step_time_ms"):
        lines.append(f"{metric:<22}" + "  ".join(f"{r.imbalance[metric].ratio:>34.3f}" for r in reports))
    return "\n".join(lines)
