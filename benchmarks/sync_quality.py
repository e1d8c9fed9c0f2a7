"""Does the 2D replica sync keep model quality? Final validation AUC / NE and the loss curve per sync variant.

Same model, same initial weights, same global batches, same number of examples, 4 CPU processes
(gloo) as 2 nodes x 2:

* ``1d``: every table sharded over all 4 ranks (no replicas, nothing to sync);
* ``2d-...``: 2 replicas of sharding groups of 2, synced with ``ReplicaSyncConfig(rows, every_n_steps,
  overlap, precision, exchange, average)``, for intervals 1/4/16/64; every variant averages over
  all replicas (``average="all_replicas"``) but ``count-aware``, which divides a row's summed change
  by the replicas that touched it (``average="touching_replicas"``, what ``"auto"`` picks for
  adaptive optimizers).

Data: the synthetic click log (``lightning_recsys.data.synthetic.click_log``, planted signal, Zipf ids), and
MovieLens-100k with ``--movielens-path`` (the ``ml-100k`` directory; labels: rating >= 4). Prints a
table (val AUC and its difference to 1D, NE, mean train loss over the last tenth of the steps,
rows per sync and the touched fraction on rank 0) and writes JSON with the loss curves.

    python benchmarks/sync_quality.py                                  # JSON: benchmarks/results/sync_quality.json
    python benchmarks/sync_quality.py --intervals 1 4 --variants 1d 2d-touched 2d-touched-overlap-bf16
    python benchmarks/sync_quality.py --movielens-path data/ml-100k --epochs 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
WORLD, PER_NODE = 4, 2
# name: (rows, overlap, precision, touching_replicas, exchange); "1d" has no sync.
KINDS: dict[str, tuple[str, bool, str, bool, str]] = {
    "2d-all": ("all", False, "fp32", False, "all_reduce"),
    "2d-all-overlap": ("all", True, "fp32", False, "all_reduce"),
    "2d-touched": ("touched", False, "fp32", False, "all_reduce"),
    "2d-touched-overlap": ("touched", True, "fp32", False, "all_reduce"),
    "2d-touched-bf16": ("touched", False, "bf16", False, "all_reduce"),
    "2d-touched-overlap-bf16": ("touched", True, "bf16", False, "all_reduce"),
    "2d-touched-count-aware": ("touched", False, "fp32", True, "all_reduce"),
    "2d-gather-overlap-bf16": ("touched", True, "bf16", False, "all_gather"),
    "2d-gather-overlap-fp8": ("touched", True, "fp8", False, "all_gather"),
}


def _data(args: argparse.Namespace) -> dict[str, Any]:
    """What the model and batches need: table sizes, dense features, a global-batch source per split."""
    if args.movielens_path:
        from lightning_recsys.data.movielens.ratings import MovieLens100KConfig

        config = MovieLens100KConfig(path=args.movielens_path, global_batch_size=args.global_batch, seed=args.seed)
        return {"dataset": "movielens-100k", "table_sizes": config.table_sizes, "num_dense": config.num_dense_features,
                "feature_names": config.feature_names, "config": config}
    from lightning_recsys.data import SyntheticClickLogConfig

    config = SyntheticClickLogConfig(
        table_sizes=[args.rows] * args.tables, num_dense_features=8, pooling_factors=args.pooling, global_batch_size=args.global_batch,
        train_batches=args.steps, val_batches=args.val_batches, seed=args.seed, zipf_exponent=args.zipf,
    )
    return {"dataset": "synthetic", "table_sizes": config.table_sizes, "num_dense": config.num_dense_features,
            "feature_names": config.feature_names, "config": config}


def _batches(data: dict[str, Any], split: str, rank: int, epochs: int) -> list[Any]:
    if data["dataset"] == "synthetic":
        from lightning_recsys.data import SyntheticClickLog
        from lightning_recsys.data.synthetic.click_log import SyntheticClickLogDataset

        config = data["config"]
        log = SyntheticClickLog(config)
        count = config.train_batches if split == "train" else config.val_batches
        dataset = SyntheticClickLogDataset(log, split, count, rank, WORLD)
    else:
        from lightning_recsys.data.movielens.ratings import MovieLens100K, MovieLens100KDataset

        dataset = MovieLens100KDataset(MovieLens100K(data["config"], warn=False), split, rank, WORLD)
    out: list[Any] = []
    for _ in range(epochs if split == "train" else 1):
        out += list(dataset)
    return out


def _train_one(rank: int, name: str, every: int, data: dict[str, Any], batches: dict[str, list[Any]], args: argparse.Namespace,
               topologies: dict[int, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_recsys.models import DLRMRanker
    from lightning_recsys.models.baselines import auc, normalized_entropy
    from lightning_recsys.parallel import EmbeddingOptimizerConfig, make_sharders, shard_model
    from lightning_recsys.parallel.sync.replica_sync import ReplicaSynchronizer
    from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
    from lightning_recsys.planner import TableConstraints, make_sharding_plan

    group_size = WORLD if name == "1d" else PER_NODE
    topology = topologies[group_size]
    torch.manual_seed(args.seed)
    model = DLRMRanker(
        table_sizes=data["table_sizes"], num_dense_features=data["num_dense"], embedding_dim=args.dim,
        dense_arch_layer_sizes=[32, args.dim], over_arch_layer_sizes=[32, 1], feature_names=data["feature_names"],
    )
    config = EmbeddingOptimizerConfig(name=args.embedding_optimizer, lr=args.embedding_lr)
    sharders = make_sharders(config.fused_params(), [args.sharding_type])
    constraints = {f"t_{f}": TableConstraints(sharding_types=[args.sharding_type]) for f in data["feature_names"]}
    plan = make_sharding_plan(model, sharders, sharding_group_size=group_size, group_ranks_per_node=group_size, compute_device="cpu",
                              constraints=constraints)
    sharded = shard_model(model, topology=topology, device=torch.device("cpu"), sharders=sharders, plan=plan)
    dense = torch.optim.Adagrad([p for p in sharded.dmp.parameters() if not sharded.is_embedding_param(p)], lr=args.dense_lr)
    sync = None
    if name != "1d":
        rows, overlap, precision, touching, exchange = KINDS[name]
        modules = [sharded.dmp.module.get_submodule(fqn) for fqn in sharded.embedding_module_fqns]
        sync_config = ReplicaSyncConfig(
            rows=rows, every_n_steps=every, overlap=overlap, precision=precision, exchange=exchange,  # type: ignore[arg-type]
            average="touching_replicas" if touching else "all_replicas",
        )
        sync = ReplicaSynchronizer.for_sharded_modules(
            modules, sharded.fused_optimizer, topology.replica_process_group(), config=sync_config,
            count_aware=sync_config.averages_over_touching_replicas(config.is_adaptive),
        )
        sync.broadcast_from_first_replica()
    losses = torch.zeros(len(batches["train"]))
    start = time.perf_counter()
    sharded.dmp.train()
    for step, batch in enumerate(batches["train"]):
        loss = F.binary_cross_entropy_with_logits(sharded.dmp(batch), batch.labels)
        loss.backward()
        dense.step()
        dense.zero_grad(set_to_none=True)
        if sync is not None:
            sync.step_ended()
        losses[step] = loss.detach()
    if sync is not None:
        sync.sync_if_pending()
    seconds = time.perf_counter() - start
    sharded.dmp.eval()
    with torch.no_grad():
        probs = torch.cat([torch.sigmoid(sharded.dmp(b)) for b in batches["val"]])
        labels = torch.cat([b.labels for b in batches["val"]])
    dist.all_reduce(losses)
    gathered = [torch.empty_like(probs) for _ in range(WORLD)], [torch.empty_like(labels) for _ in range(WORLD)]
    dist.all_gather(gathered[0], probs)
    dist.all_gather(gathered[1], labels)
    totals = sync.totals if sync is not None else None
    if sync is not None:
        sync.close()
    if rank != 0:
        return {}
    p, y = torch.cat(gathered[0]).double().numpy(), torch.cat(gathered[1]).double().numpy()
    curve = (losses / WORLD).tolist()
    tail = max(1, len(curve) // 10)
    return {
        "name": name, "every_n_steps": every if name != "1d" else None, "val_auc": auc(p, y), "val_ne": normalized_entropy(p, y),
        "final_train_loss": float(np.mean(curve[-tail:])), "loss_curve": _windows(curve, args.curve_points), "train_seconds": round(seconds, 2),
        "syncs": totals.syncs if totals else 0, "rows_per_sync": totals.rows_per_sync if totals else None,
        "touched_fraction": totals.touched_fraction if totals else None, "bytes_per_sync": totals.bytes_per_sync if totals else None,
    }


def _windows(curve: list[float], points: int) -> list[float]:
    size = max(1, math.ceil(len(curve) / points))
    return [round(float(np.mean(curve[i : i + size])), 5) for i in range(0, len(curve), size)]


def _worker(rank: int, world: int, runs: list[tuple[str, int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from lightning_recsys.parallel import ParallelTopology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    topologies = {}
    for group_size in sorted({WORLD if name == "1d" else PER_NODE for name, _ in runs}):
        topologies[group_size] = ParallelTopology(world_size=WORLD, sharding_group_size=group_size, ranks_per_node=PER_NODE)
        topologies[group_size].device_mesh("cpu")
    data = _data(args)
    batches = {"train": _batches(data, "train", rank, args.epochs), "val": _batches(data, "val", rank, 1)}
    results = []
    for name, every in runs:
        result = _train_one(rank, name, every, data, batches, args, topologies)
        if rank == 0:
            print(f"  {name} every {every}: val AUC {result['val_auc']:.4f} ({result['train_seconds']} s)", flush=True)
        results.append(result)
    dist.destroy_process_group()
    return results


def _print(result: dict[str, Any]) -> None:
    runs = result["runs"]
    base = next((r for r in runs if r["name"] == "1d"), None)
    print(f"\n{result['dataset']}: {result['examples_per_run']:,} training examples per run, {result['val_examples']:,} validation")
    print(f"{'variant':<26}{'every':>6}{'val AUC':>9}{'dAUC':>9}{'val NE':>8}{'loss':>8}{'rows/sync':>11}{'touched':>9}")
    for r in runs:
        delta = f"{r['val_auc'] - base['val_auc']:+.4f}" if base else "n/a"
        rows = f"{r['rows_per_sync']:.0f}" if r["rows_per_sync"] is not None else "-"
        touched = f"{r['touched_fraction']:.3f}" if r["touched_fraction"] is not None else "-"
        print(f"{r['name']:<26}{r['every_n_steps'] or '-':>6}{r['val_auc']:>9.4f}{delta:>9}{r['val_ne']:>8.4f}{r['final_train_loss']:>8.4f}"
              f"{rows:>11}{touched:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["1d", *KINDS], choices=["1d", *KINDS])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--movielens-path", help="MovieLens-100k directory (u.user, u.item, u1.base, u1.test)")
    parser.add_argument("--steps", type=int, default=240, help="synthetic: global batches per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--val-batches", type=int, default=40, help="synthetic: validation global batches")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=20_000, help="synthetic: rows per table")
    parser.add_argument("--pooling", type=float, default=2.0)
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--embedding-optimizer", default="rowwise_adagrad", choices=["sgd", "rowwise_adagrad", "adam"])
    parser.add_argument("--embedding-lr", type=float, default=0.05)
    parser.add_argument("--dense-lr", type=float, default=0.05)
    parser.add_argument("--sharding-type", default="row_wise", choices=["table_wise", "row_wise", "column_wise"])
    parser.add_argument("--curve-points", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, default=RESULTS / "sync_quality.json")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.intervals):
        parser.error(f"--intervals {args.intervals}: every interval must be >= 1")
    if args.global_batch % WORLD:
        parser.error(f"--global-batch {args.global_batch} must be a multiple of {WORLD} (the ranks' slices are equal)")
    runs = [("1d", 0)] if "1d" in args.variants else []
    runs += [(name, every) for name in args.variants if name != "1d" for every in args.intervals]

    from lightning_recsys.testing.processes import run_ranks

    start = time.perf_counter()
    print(f"{len(runs)} runs, {WORLD} processes (2 nodes x 2, gloo)", flush=True)
    per_rank = run_ranks(_worker, WORLD, runs, args, timeout=args.timeout, ranks_per_node=PER_NODE)
    data = _data(args)
    examples = (args.steps * args.epochs * args.global_batch) if data["dataset"] == "synthetic" else None
    result = {
        "dataset": data["dataset"], "examples_per_run": examples or 0, "val_examples": args.val_batches * args.global_batch,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_seconds": round(time.perf_counter() - start, 1), "runs": per_rank[0],
    }
    if data["dataset"] != "synthetic":
        result["examples_per_run"] = sum(len(b.labels) for b in _batches(data, "train", 0, args.epochs)) * WORLD
        result["val_examples"] = sum(len(b.labels) for b in _batches(data, "val", 0, 1)) * WORLD
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"JSON: {args.json} ({result['wall_seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
