"""Does a pretrained foundation model help the ranker? Warm-started against from-scratch on DIN pairs.

The foundation setting: ``SequencePretrainer`` (``examples/configs/beauty_pretrain.yaml``) pre-trains on
every user's training sequence; the ranker (``examples/configs/beauty_ranker.yaml``, ``SequenceRanker``
with the pretrainer's own encoder, the candidate appended) then trains on the DIN pairs of a fraction
of the users only (``--fractions``; ``SequenceFileRankingDataModule(train_user_fraction=...)``) and is
tested on every user's leave-one-out pair. For each fraction and seed this trains:

* ``scratch``: the ranker from its random initialisation;
* ``warm``: the same ranker, same budget and seed, started from the pretraining checkpoint of the same
  seed through ``lightning_recsys.callbacks.InitFromCheckpoint`` (the encoder and the item table);
* ``dlrm``: ``examples/configs/beauty_dlrm.yaml``, DLRM with the candidate and the history summed
  into one bag, no sequence model;

and scores ``popularity``: each candidate's count among the positives of the trained users' pairs.
Every fit keeps its best epoch by validation AUC and is tested from it (the configs' ModelCheckpoint).
The pretraining checkpoints come from ``--pretrain-checkpoints`` (one per seed, in ``--seeds``
order), or are made here: ``beauty_pretrain.yaml`` once per seed (about 25 min each on 2 cores).

    python benchmarks/warm_start_quality.py --path beauty.txt --seeds 0 1 2                 # pre-trains too
    python benchmarks/warm_start_quality.py --path beauty.txt --seeds 0 1 2 --fractions 0.25 \\
        --pretrain-checkpoints ck0 ck1 ck2                                                  # reuse checkpoints
    python benchmarks/warm_start_quality.py --path beauty.txt --seeds 0 --fractions 0.25 --models warm \\
        --pretrain-checkpoints ck2d --ranker-override "--trainer.devices 2"                # a 2D checkpoint into 1D

Prints a table per fraction (mean test AUC over the seeds, its standard deviation, each seed) and the
warm - scratch difference per seed; JSON in ``--json`` (default ``benchmarks/results/warm_start_quality.json``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml
from torchmetrics.functional.classification import binary_auroc

import quality  # a sibling: benchmarks/ is the script's folder (and on pytest's pythonpath)

from lightning_recsys.data.sequences import SequenceFileRankingDataModule

CONFIGS = quality.CONFIGS
MODELS = ("scratch", "warm", "dlrm")


def popularity(path: str, num_items: int, fraction: float, seed: int, max_history: int) -> dict:
    """Test and validation AUC of scoring each candidate by its count among the trained users' positives."""
    data = SequenceFileRankingDataModule(path, num_items, max_history=max_history, train_user_fraction=fraction, seed=seed)
    pairs = data.pairs
    users, positions = pairs.points("train")
    positives = pairs.sequences.items[pairs.sequences.offsets[users] + positions]
    counts = torch.from_numpy(np.bincount(positives, minlength=num_items + 1).astype(np.float32))
    result: dict = {"trained_users": int(len(np.unique(users))), "train_pairs": int(len(users))}
    for stage in ("val", "test"):
        scores, labels = [], []
        for batch in data._dataset(stage, 0, 1):
            candidates = batch.sparse["candidate_item_id"].values()
            scores.append(counts[candidates])
            labels.append(batch.labels)
        result[stage] = {f"{stage}/auc": float(binary_auroc(torch.cat(scores), torch.cat(labels).long()))}
    return result


def pretrain(path: str, seed: int, config: Path, workdir: Path) -> str:
    """One pretraining fit of ``config`` with this seed; the path of its best checkpoint (by val/ndcg@10)."""
    seed_dir = workdir / f"pretrain-{seed}"
    seed_dir.mkdir()
    run = quality._train_in_subprocess(config, ["--data.path", path, "--data.seed", str(seed)], seed, seed_dir)
    found = sorted(seed_dir.glob(f"checkpoints/*/{run['best_checkpoint']}"))
    if not found:
        raise RuntimeError(f"pretraining seed {seed} reported best checkpoint {run['best_checkpoint']!r}, not found under {seed_dir}.")
    return str(found[0])


def fit(model: str, args: argparse.Namespace, fraction: float, seed: int, checkpoint: str | None, workdir: Path) -> dict:
    """One fit and test of ``model`` at this fraction and seed, in its own folder and processes."""
    run_dir = workdir / f"{model}-f{fraction}-s{seed}"
    run_dir.mkdir()
    data = ["--data.path", args.path, "--data.train_user_fraction", str(fraction), "--data.seed", str(seed)]
    if model == "dlrm":
        return quality._train_in_subprocess(args.dlrm_config, [*data, *shlex.split(args.dlrm_override)], seed, run_dir)
    overrides = [*data, *shlex.split(args.ranker_override)]
    if model == "warm":
        overrides += ["--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint", "--trainer.callbacks.path", str(checkpoint)]
        if args.rename:
            overrides += ["--trainer.callbacks.rename", args.rename]
    return quality._train_in_subprocess(args.ranker_config, overrides, seed, run_dir)


def summarize(runs: list[dict], stage: str = "test") -> dict:
    values = np.array([run[stage][f"{stage}/auc"] for run in runs])
    return {"auc": float(values.mean()), "auc_std": float(values.std(ddof=1)) if len(values) > 1 else 0.0, "per_seed": values.tolist()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="the BERT4Rec-format sequence file (Beauty)")
    parser.add_argument("--num-items", type=int, default=54542, help="the configs' item table rows (Beauty's largest id)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 1.0], help="train_user_fraction of the ranker fits")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--pretrain-checkpoints", nargs="+", default=None, help="one per seed (in --seeds order); default: pre-train here")
    parser.add_argument("--rename", default="", help="InitFromCheckpoint's rename, as JSON (checkpoint key prefix -> model key prefix)")
    parser.add_argument("--pretrain-config", type=Path, default=CONFIGS / "beauty_pretrain.yaml")
    parser.add_argument("--ranker-config", type=Path, default=CONFIGS / "beauty_ranker.yaml")
    parser.add_argument("--dlrm-config", type=Path, default=CONFIGS / "beauty_dlrm.yaml")
    parser.add_argument("--ranker-override", default="", help="CLI arguments for both ranker fits, one quoted string")
    parser.add_argument("--dlrm-override", default="", help="CLI arguments for the DLRM fits, one quoted string")
    parser.add_argument("--json", type=Path, default=quality.RESULTS / "warm_start_quality.json")
    args = parser.parse_args(argv)
    args.path = str(Path(args.path).resolve())
    if args.pretrain_checkpoints is not None and len(args.pretrain_checkpoints) != len(args.seeds):
        parser.error(f"--pretrain-checkpoints has {len(args.pretrain_checkpoints)} paths for {len(args.seeds)} seeds; give one per seed.")
    if any(not 0 < fraction <= 1 for fraction in args.fractions):
        parser.error(f"--fractions {args.fractions}: each must be in (0, 1].")
    workdir = Path(tempfile.mkdtemp(prefix="warm-start-"))
    print(f"work folder: {workdir}")
    checkpoints: list[str | None] = [None] * len(args.seeds)
    if "warm" in args.models:
        checkpoints = [str(Path(c).resolve()) for c in args.pretrain_checkpoints] if args.pretrain_checkpoints else [
            pretrain(args.path, seed, args.pretrain_config, workdir) for seed in args.seeds
        ]
    result: dict = {"path": args.path, "seeds": args.seeds, "pretrain_checkpoints": checkpoints, "rename": args.rename,
                    "ranker_override": args.ranker_override, "fractions": {}}
    for fraction in args.fractions:
        entry: dict = {"runs": {}, "popularity": [], "mean": {}}
        for model in args.models:
            runs = []
            for seed, checkpoint in zip(args.seeds, checkpoints):
                run = {**fit(model, args, fraction, seed, checkpoint, workdir), "seed": seed}
                runs.append(run)
                print(f"fraction {fraction} {model} seed {seed}: test AUC {run['test']['test/auc']:.4f} "
                      f"(best val {run.get('best_val', float('nan')):.4f} at epoch {run.get('best_epoch')}; fit {run['fit_seconds']:.0f} s)", flush=True)
                entry["runs"][model] = runs  # written after every fit: a later failure loses nothing measured
                result["fractions"][str(fraction)] = entry
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(result, indent=2))
            entry["mean"][model] = summarize(runs)
        max_history = yaml.safe_load(args.ranker_config.read_text())["data"]["init_args"]["max_history"]  # the ranker's own examples
        entry["popularity"] = [popularity(args.path, args.num_items, fraction, seed, max_history) for seed in args.seeds]
        entry["mean"]["popularity"] = summarize(entry["popularity"])
        result["fractions"][str(fraction)] = entry
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print_result(result)
    print(f"JSON: {args.json}")
    return 0


def print_result(result: dict) -> None:
    for fraction, entry in result["fractions"].items():
        pop = entry["popularity"][0]
        print(f"\ntrain_user_fraction {fraction}: {pop['trained_users']} trained users, {pop['train_pairs']} training pairs "
              f"(seed {result['seeds'][0]}); test AUC over seeds {result['seeds']}")
        print(f"{'':<12}{'mean':>8}{'std':>8}  per seed")
        for name, summary in entry["mean"].items():
            seeds = " ".join(f"{value:.4f}" for value in summary["per_seed"])
            print(f"{name:<12}{summary['auc']:>8.4f}{summary['auc_std']:>8.4f}  {seeds}")
        if "warm" in entry["mean"] and "scratch" in entry["mean"]:
            deltas = np.array(entry["mean"]["warm"]["per_seed"]) - np.array(entry["mean"]["scratch"]["per_seed"])
            print(f"{'warm-scratch':<12}{deltas.mean():>+8.4f}{'':>8}  " + " ".join(f"{d:+.4f}" for d in deltas))


if __name__ == "__main__":
    sys.exit(main())
