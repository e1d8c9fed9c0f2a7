"""The pretraining part of ``benchmarks/quality.py``: a sequence config's test HR@K / NDCG@K / MRR over seeds,
beside a most-popular baseline under the same protocol (every item ranked, the user's seen items removed).

The baseline scores each item by how often it occurs in the training split (every user's items but the
last two), the same ranking for every user; its rank of a target counts ties against the target, as the
model's ranking does (``lightning_recsys.parallel.ranking``), so items never seen in training all tie.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lightning_recsys.data.sequences import SequencePretrainDataModule
from lightning_recsys.models import RankingMetrics
from lightning_recsys.parallel.ranking import UnshardedItemRanking

METRICS = ("hr@10", "ndcg@10", "hr@100", "ndcg@100", "mrr")


def most_popular(datamodule: SequencePretrainDataModule) -> dict:
    """Validation and test metrics of ranking every user's unseen items by their training-split count."""
    start = time.perf_counter()
    sequences, split = datamodule.sequences, datamodule.split
    users, ends = split.examples("train")
    first = sequences.offsets[users]
    lengths = ends
    positions = np.repeat(first, lengths) + np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    counts = np.bincount(sequences.items[positions], minlength=datamodule.num_items).astype(np.float32)
    ranking = UnshardedItemRanking(torch.from_numpy(counts)[:, None])  # score = count: a one-column table, query 1
    result: dict = {}
    for stage in ("val", "test"):
        metrics = RankingMetrics((10, 100))
        for batch in datamodule._dataset(stage, 0, 1):
            lengths_in = batch.sparse["item_id"].lengths()
            targets = batch.next_item_ids[torch.cumsum(lengths_in, 0) - 1]
            queries = torch.ones(batch.batch_size, 1)
            metrics.update(ranking.target_ranks(queries, targets, batch.seen_ids, batch.seen_lengths))
        result[stage] = {name: float(value) for name, value in metrics.compute().items()}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def mean_over_seeds(runs: list[dict]) -> dict:
    """Each test metric's mean and standard deviation over the runs, and the fits' mean wall time."""
    out: dict = {}
    for name in METRICS:
        values = np.array([run["test"].get(f"test/{name}", math.nan) for run in runs])
        out[name] = float(values.mean())
        out[f"{name}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    out["fit_seconds"] = float(np.mean([run["fit_seconds"] for run in runs]))
    return out


def compare(
    config: Path, overrides: list[str], seeds: list[int], datamodule: SequencePretrainDataModule,
    train: Callable[[Path, list[str], int], dict], parallel: bool = False,
) -> dict:
    """``train(config, overrides, seed)`` once per seed (its data seed too), then the baseline.

    ``parallel``: the seeds' fits run at the same time (each in its own processes), which shortens the
    wall time on a machine with cores to spare and lengthens each fit's ``fit_seconds``.
    """
    with ThreadPoolExecutor(max_workers=len(seeds) if parallel else 1) as pool:
        runs = list(pool.map(lambda seed: train(config, [*overrides, "--data.seed", str(seed)], seed), seeds))
    return {
        "dataset": "sequences", "config": str(config), "overrides": overrides, "seeds": seeds,
        "data": {"users": int(datamodule.sequences.num_users), "items": int(datamodule.num_items), **datamodule.num_examples},
        "runs": runs, "mean": mean_over_seeds(runs), "baseline": most_popular(datamodule), "parallel_seeds": parallel,
    }


def print_comparison(result: dict) -> None:
    data = result["data"]
    print(f"\n{result['config']} {' '.join(result['overrides'])}, seeds {result['seeds']}")
    print(f"{data['users']} users, {data['items']} items; examples train {data['train']}, val {data['val']}, test {data['test']}")
    header = "".join(f"{'test ' + name:>15}" for name in METRICS)
    print(f"{'':<14}{header}  notes")
    mean = result["mean"]
    runs = result["runs"]
    together = ", seeds run at once" if result.get("parallel_seeds") else ""
    notes = f"mean of {len(runs)} (NDCG@10 std {mean['ndcg@10_std']:.4f}); fit {mean['fit_seconds']:.0f} s, {runs[0]['world_size']} processes{together}"
    print(f"{'model':<14}" + "".join(f"{mean[name]:>15.4f}" for name in METRICS) + f"  {notes}")
    for run in runs:
        best = f"best val/ndcg@10 {run.get('best_val', math.nan):.4f} at epoch {run.get('best_epoch')}"
        print(f"{'  seed ' + str(run['seed']):<14}" + "".join(f"{run['test'].get('test/' + name, math.nan):>15.4f}" for name in METRICS)
              + f"  {best}; fit {run['fit_seconds']:.0f} s, {run['epochs_run']} epochs")
    baseline = result["baseline"]["test"]
    print(f"{'most popular':<14}" + "".join(f"{baseline[name]:>15.4f}" for name in METRICS) + "  training-split counts, seen items removed")
