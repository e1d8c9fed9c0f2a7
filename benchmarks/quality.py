"""Does a shipped example config beat the baselines without learning? Model AUC / NE next to theirs.

MovieLens-100k (``--path``, the extracted ``ml-100k`` directory; not bundled, its licence forbids
redistribution): trains ``examples/configs/movielens_dlrm.yaml`` on ``u1.base`` (a random
``val_fraction`` of it validates: the DataModule's ``val_holdout``) and tests on ``u1.test``. The
baselines (``lightning_recsys.models.baselines``) are fit on the DataModule's own training ratings;
their smoothing strength is picked on its validation ratings, then they score ``u1.test``.

Criteo (``--criteo-path``, a directory of TorchRec npy files, ``day_{i}_{dense,sparse,labels}.npy``):
trains the model of ``examples/configs/criteo_dlrm.yaml`` on ``CriteoBinaryDataModule`` with the
given days (``--data lightning_recsys.data.CriteoBinaryDataModule``). The baseline is popularity: the smoothed positive rate of one categorical feature's
value, the feature picked on the validation day.

``--sequence`` also trains ``examples/configs/movielens_sequence.yaml`` (``SequenceRanker`` on
``MovieLens100KSequenceDataModule``: the same ratings, each with the user's strictly earlier training
ratings as its history) on the same split, and adds the history-aware baselines: the user's recent
positive rate (``RecentPositiveRateBaseline``; window and strength picked on val), alone and with the
movie's rate. ``--seeds 0 1 2`` trains each config once per seed (each fit in its own process) and
reports the mean and standard deviation of test AUC, NE and logloss. ``--synthetic-sequence`` compares
``examples/configs/synthetic_sequence.yaml`` with the shipped synthetic DLRM's model on the same
examples without their history (``emit_history=False``), next to the AUC of the logit the labels were
drawn from (the ceiling) and of its non-history part.

``--make-synthetic DIR`` writes a MovieLens-100k-format directory (943 users, 1682 movies, 100k
ratings, ``u1.base``/``u1.test``) whose labels come from planted user and item biases, user x
movie latent factors and user-genre affinities; it is for tuning and testing the script, not a
stand-in for the real data's numbers.

    python benchmarks/quality.py --path data/ml-100k                       # JSON: benchmarks/results/quality.json
    python benchmarks/quality.py --make-synthetic /tmp/ml-synth && python benchmarks/quality.py --path /tmp/ml-synth
    python benchmarks/quality.py --path data/ml-100k --override --model.init_args.embedding_dim 32
    python benchmarks/quality.py --path data/ml-100k --split time --sequence --seeds 0 1 2
    python benchmarks/quality.py --path data/ml-100k --split time --sequence --history all_earlier --seeds 0 1 2
    python benchmarks/quality.py --synthetic-sequence --seeds 0 1 2
    python benchmarks/quality.py --criteo-path npy/ --train-days 0 1 2 --val-days 3 --test-days 4
    python benchmarks/quality.py --pretrain-path beauty.txt --seeds 0 1 2
    python benchmarks/quality.py --synthetic-pretrain

``--pretrain-path FILE`` trains ``examples/configs/beauty_pretrain.yaml`` (``SequencePretrainer``) on a
BERT4Rec-format sequence file, once per seed (``--seeds``; the data's seed follows it), tests the
checkpoint of the best epoch by ``val/ndcg@10`` and prints test HR@10/NDCG@10/HR@100/NDCG@100/MRR next
to a most-popular baseline (``benchmarks/_pretrain_quality.py``); ``--synthetic-pretrain`` does the same
with ``synthetic_pretrain.yaml``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

    from lightning_recsys.data.movielens.ratings import MovieLens100KConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
RESULTS = Path(__file__).resolve().parent / "results"
STRENGTHS = [0.0, 1.0, 3.0, 10.0, 30.0, 100.0]
_HOLDOUT_WORDS = {"random": "a random draw", "newest": "the newest"}


# ----------------------------------------------------------------------------- synthetic MovieLens


def make_synthetic_movielens(directory: Path, seed: int = 0, num_ratings: int = 100_000, interaction: float = 1.0) -> None:
    """A MovieLens-100k-format directory with planted structure (see the module docstring)."""
    from lightning_recsys.data.movielens.ratings import GENRES, OCCUPATIONS

    rng = np.random.default_rng(seed)
    users, items, dim = 943, 1682, 8
    directory.mkdir(parents=True, exist_ok=True)
    ages = rng.integers(7, 74, users)
    genders = rng.random(users) < 0.29
    occupations = rng.integers(0, len(OCCUPATIONS), users)
    zips = rng.integers(0, 100_000, users)
    (directory / "u.user").write_text(
        "".join(f"{u + 1}|{ages[u]}|{'F' if genders[u] else 'M'}|{OCCUPATIONS[occupations[u]]}|{zips[u]:05d}\n" for u in range(users))
    )
    genre_flags = rng.random((items, len(GENRES))) < 0.12
    years = rng.integers(1922, 1999, items)
    lines = []
    for i in range(items):
        date = f"01-Jan-{years[i]}" if rng.random() > 0.01 else ""
        flags = "|".join("1" if f else "0" for f in genre_flags[i])
        lines.append(f"{i + 1}|Movie {i + 1} ({years[i]})|{date}||http://example.invalid/{i + 1}|{flags}\n")
    (directory / "u.item").write_bytes("".join(lines).encode("latin-1"))

    # Who rates what: active users and popular movies, without repeats.
    activity = rng.lognormal(0.0, 1.0, users)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.9
    rng.shuffle(popularity)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < num_ratings:
        u = rng.choice(users, size=num_ratings, p=activity / activity.sum())
        i = rng.choice(items, size=num_ratings, p=popularity / popularity.sum())
        for pair in zip(u.tolist(), i.tolist()):
            pairs.add(pair)
            if len(pairs) == num_ratings:
                break
    u, i = (np.array(x) for x in zip(*sorted(pairs)))
    user_bias, item_bias = rng.normal(0.3, 0.8, users), rng.normal(0.0, 0.8, items)
    user_factors, item_factors = rng.normal(0, 1, (users, dim)), rng.normal(0, 1, (items, dim))
    genre_taste = rng.normal(0, 0.6, (users, len(GENRES)))
    logit = (
        user_bias[u] + item_bias[i]
        + interaction * (user_factors[u] * item_factors[i]).sum(1) / math.sqrt(dim)
        + interaction * (genre_taste[u] * genre_flags[i]).sum(1)
        + 0.3 * ((ages[u] > 35) == (years[i] < 1970))
    )
    positive = rng.random(len(u)) < 1 / (1 + np.exp(-logit))
    ratings = np.where(positive, rng.integers(4, 6, len(u)), rng.integers(1, 4, len(u)))
    timestamps = 874_724_710 + rng.integers(0, 18_000_000, len(u))
    order = rng.permutation(len(u))
    rows = [f"{u[k] + 1}\t{i[k] + 1}\t{ratings[k]}\t{timestamps[k]}\n" for k in order]
    (directory / "u.data").write_text("".join(rows))
    cut = len(rows) * 4 // 5  # u1: a random 80 / 20 split, as MovieLens's u1.base / u1.test
    (directory / "u1.base").write_text("".join(rows[:cut]))
    (directory / "u1.test").write_text("".join(rows[cut:]))


# ----------------------------------------------------------------------------- baselines


def _baselines_movielens(config: MovieLens100KConfig) -> dict:
    """Fit on ``config``'s train ratings, pick the strength on its val ratings: the model's own split."""
    from lightning_recsys.data.movielens.ratings import MovieLens100K
    from lightning_recsys.models.baselines import PopularityBaseline, UserItemBiasBaseline, auc, log_loss, normalized_entropy

    data = MovieLens100K(config, warn=False)
    arrays = {name: np.array(data.ratings[name]).reshape(-1, 3) for name in ("train", "val", "test")}
    users, items, labels = (arrays["train"][:, k] for k in range(3))
    out: dict = {"ratings": {name: len(a) for name, a in arrays.items()}}
    for name in ("popularity", "user_item_bias"):
        best = None
        for strength in STRENGTHS:
            if name == "popularity":
                model = PopularityBaseline(strength).fit(items.astype(int), labels, config.num_items)
                score = lambda a, model=model: model.predict(a[:, 1].astype(int))  # noqa: E731
            else:
                model = UserItemBiasBaseline(strength).fit(users.astype(int), items.astype(int), labels, config.num_users, config.num_items)
                score = lambda a, model=model: model.predict(a[:, 0].astype(int), a[:, 1].astype(int))  # noqa: E731
            val = arrays["val"] if len(arrays["val"]) else arrays["train"]
            val_auc = auc(score(val), val[:, 2])
            if best is None or val_auc > best["val_auc"]:
                test = score(arrays["test"])
                best = {
                    "strength": strength, "val_auc": val_auc,
                    "test_auc": auc(test, arrays["test"][:, 2]), "test_ne": normalized_entropy(test, arrays["test"][:, 2]),
                    "test_logloss": log_loss(test, arrays["test"][:, 2]),
                }
        out[name] = best
    return out


def _baselines_criteo(path: str, train_days: list[int], val_days: list[int], test_days: list[int]) -> dict:
    from lightning_recsys.data.criteo.binary import day_file
    from lightning_recsys.models.baselines import SmoothedRate, auc, normalized_entropy

    def load(days: list[int], kind: str) -> np.ndarray:
        return np.concatenate([np.load(day_file(path, d, kind), mmap_mode="r") for d in days])

    labels = {s: load(d, "labels").reshape(-1).astype(np.float64) for s, d in (("train", train_days), ("val", val_days), ("test", test_days))}
    sparse = {s: load(d, "sparse") for s, d in (("train", train_days), ("val", val_days), ("test", test_days))}
    best = None
    for f in range(sparse["train"].shape[1]):
        # Exact stored values (no hashing): the baseline gets no collisions.
        values, inverse = np.unique(np.concatenate([sparse[s][:, f] for s in ("train", "val", "test")]), return_inverse=True)
        cuts = np.cumsum([len(sparse[s]) for s in ("train", "val", "test")])[:-1]
        keys = dict(zip(("train", "val", "test"), np.split(inverse, cuts)))
        rate = SmoothedRate.fit(keys["train"], labels["train"], len(values), strength=10.0)
        val_auc = auc(rate(keys["val"]), labels["val"])
        if best is None or val_auc > best["val_auc"]:
            test = rate(keys["test"])
            best = {"feature": f"cat_{f}", "strength": 10.0, "val_auc": val_auc,
                    "test_auc": auc(test, labels["test"]), "test_ne": normalized_entropy(test, labels["test"])}
    return {"examples": {s: len(v) for s, v in labels.items()}, "popularity": best}


WINDOWS: list[int | None] = [5, 10, 20, 50, None]


def _baselines_history(config: MovieLens100KConfig, history: str = "train") -> dict:
    """The history-aware baselines (``RecentPositiveRateBaseline``) on the sequence DataModule's histories.

    A history is the user's strictly earlier training ratings (``MovieLens100KSequenceDataModule``);
    with ``history="all_earlier"`` a validation or test rating's is every earlier rating of its user,
    from any split, as the DataModule's option. Its positives are the ratings >= 4. The window, the
    strength and the item term are picked on val.
    """
    from lightning_recsys.data.movielens.ratings import POSITIVE_RATING, MovieLens100K
    from lightning_recsys.data.movielens.histories import TrainingHistories
    from lightning_recsys.models.baselines import RecentPositiveRateBaseline, auc, log_loss, normalized_entropy

    data = MovieLens100K(config, warn=False)
    histories = TrainingHistories(data, max_length=10**9)
    served = TrainingHistories(data, max_length=10**9, splits=("train", "val", "test")) if history == "all_earlier" else histories
    splits = {}
    for name in ("train", "val", "test"):
        users = np.array([u for u, _, _ in data.ratings[name]], dtype=np.int64)
        times = np.array([t for _, t in data.rating_times[name]], dtype=np.int64)
        _, actions, lengths = (histories if name == "train" else served).before(users, times)
        items = np.array([i for _, i, _ in data.ratings[name]], dtype=np.int64)
        labels = np.array([label for _, _, label in data.ratings[name]])
        splits[name] = {"positive": (actions.numpy() >= POSITIVE_RATING - 1), "lengths": lengths.numpy(), "items": items, "labels": labels}
    train, val, test = splits["train"], splits["val"] if len(splits["val"]["labels"]) else splits["train"], splits["test"]
    out: dict = {}
    for name, with_item in (("recent_rate", False), ("recent_rate_item", True)):
        best = None
        for window in WINDOWS:
            for strength in STRENGTHS[1:]:  # strength 0 would score an empty history's 0 / 0
                model = RecentPositiveRateBaseline(window, strength, with_item).fit(train["labels"], train["items"], config.num_items)
                score = lambda d, model=model: model.predict(d["positive"], d["lengths"], d["items"])  # noqa: E731
                val_auc = auc(score(val), val["labels"])
                if best is None or val_auc > best["val_auc"]:
                    scores = score(test)
                    best = {
                        "window": window, "strength": strength, "val_auc": val_auc, "test_auc": auc(scores, test["labels"]),
                        "test_ne": normalized_entropy(scores, test["labels"]), "test_logloss": log_loss(scores, test["labels"]),
                    }
        out[name] = best
    out["empty_history_share"] = {s: float(np.mean(d["lengths"] == 0)) if len(d["lengths"]) else 0.0 for s, d in splits.items()}
    return out


def _synthetic_dlrm_config(sequence_config: Path, workdir: Path) -> Path:
    """The shipped synthetic DLRM's model and strategy on a sequence config's examples, without their history features."""
    import yaml

    sequence = yaml.safe_load(sequence_config.read_text())
    dlrm = yaml.safe_load((CONFIGS / "synthetic_dlrm.yaml").read_text())
    data = sequence["data"]["init_args"]
    from lightning_recsys.data.synthetic.sequence_log import CANDIDATE_ITEM_FEATURE, SyntheticSequenceConfig

    resolved = SyntheticSequenceConfig(**data)  # the DataModule's keyword arguments are the config's fields
    model = dict(dlrm["model"]["init_args"])
    model.update(
        feature_names=[CANDIDATE_ITEM_FEATURE, *resolved.context_feature_names],
        table_sizes=[resolved.num_items, *resolved.context_table_sizes],
        num_dense_features=resolved.num_dense_features,
    )
    without_history = {**sequence["data"], "init_args": {**data, "emit_history": False}}
    config = {**sequence, "model": {"class_path": dlrm["model"]["class_path"], "init_args": model}, "data": without_history}
    config["trainer"] = {**sequence["trainer"], "strategy": dlrm["trainer"]["strategy"]}
    path = workdir / "synthetic_sequence_dlrm.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _synthetic_ceiling(sequence_config: Path, overrides: list[str], workdir: Path) -> dict:
    """The AUC of the logit the test labels were drawn from (no model can beat it), and of its non-history part."""
    from lightning_recsys.models.baselines import auc

    cli = _build(sequence_config, overrides, workdir)
    log = cli.datamodule.log
    planted, context, labels = [], [], []
    for index in range(log.config.test_batches):
        batch = log.global_batch("test", index)
        planted.append(log.planted_logit(batch).numpy())
        cfg = log.config
        context.append(log.context_logit([batch.sparse[n].values() for n in cfg.context_feature_names], batch.dense).numpy())
        labels.append(batch.labels.numpy())
    y = np.concatenate(labels)
    return {"planted_logit_auc": auc(np.concatenate(planted), y), "context_only_auc": auc(np.concatenate(context), y)}


# ----------------------------------------------------------------------------- the model


def _build(config: Path, overrides: list[str], workdir: Path) -> LightningCLI:
    """The config's Trainer, model and DataModule, built by the CLI's own parser (nothing runs yet)."""
    from lightning_recsys.cli import build_cli

    args = ["--config", str(config), "--trainer.default_root_dir", str(workdir), "--trainer.enable_progress_bar", "false", *overrides]
    return build_cli(args, run=False)


def _train(cli: LightningCLI) -> dict:
    """fit then test through the CLI's own objects; metrics of rank 0."""
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    fit_seconds = time.perf_counter() - start
    val = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
    epochs = cli.trainer.current_epoch
    best = cli.trainer.checkpoint_callback
    chosen = best is not None and best.monitor is not None and best.best_model_path
    # A config that keeps its best epoch (by validation) is tested from it; the others from the last step.
    cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False, ckpt_path="best" if chosen else None)
    test = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("test/")}
    result = {
        "rank": cli.trainer.global_rank, "world_size": cli.trainer.world_size, "epochs_run": epochs,
        "fit_seconds": round(fit_seconds, 1), "val": val, "test": test,
    }
    if chosen:
        result.update(best_val=float(best.best_model_score), best_checkpoint=Path(best.best_model_path).name)
        result["best_epoch"] = int(result["best_checkpoint"].split("epoch")[1][:2]) if "epoch" in result["best_checkpoint"] else None
    return result


def _train_in_subprocess(config: Path, overrides: list[str], seed: int, workdir: Path) -> dict:
    """One fit and test of ``config`` in a fresh process (its strategy launches its own ranks), rank 0's metrics."""
    out = workdir / f"run-{config.stem}-{seed}-{time.monotonic_ns()}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--train-only", str(config), "--seed", str(seed), "--json", str(out),
               "--override", *overrides]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=workdir)  # a config's relative checkpoint dir lands in workdir
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return {**json.loads(out.read_text())["model"], "seed": seed}


def _mean_over_seeds(runs: list[dict]) -> dict:
    """Test AUC, NE and logloss: mean and standard deviation over the seeds' runs."""
    out = {}
    for metric in ("auc", "ne", "logloss"):
        values = np.array([run["test"].get(f"test/{metric}", math.nan) for run in runs])
        out[metric] = float(values.mean())
        out[f"{metric}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return out


def _compare(args: argparse.Namespace, workdir: Path) -> dict:
    """The DLRM config and (with --sequence) the sequence config on the same data, over every seed, with the baselines."""
    models: dict[str, tuple[Path, list[str]]] = {}
    if args.synthetic_sequence:
        sequence_config = args.sequence_config or CONFIGS / "synthetic_sequence.yaml"
        data_overrides = shlex.split(args.data_override)
        result: dict = {"dataset": "synthetic-sequence", "path": None, "config": str(sequence_config)}
        models["dlrm"] = (args.config or _synthetic_dlrm_config(sequence_config, workdir), [*data_overrides, *args.override])
        models["sequence"] = (sequence_config, [*data_overrides, *shlex.split(args.sequence_override)])
        result["baselines"] = _synthetic_ceiling(sequence_config, data_overrides, workdir)
    else:
        config = args.config or CONFIGS / "movielens_dlrm.yaml"
        data = ["--data.path", args.path, "--data.split", args.split, *shlex.split(args.data_override)]
        models["dlrm"] = (config, [*data, *args.override])
        if args.sequence:
            history = ["--data.history", args.history]
            models["sequence"] = (args.sequence_config or CONFIGS / "movielens_sequence.yaml", [*data, *history, *shlex.split(args.sequence_override)])
        data_config = _build(config, models["dlrm"][1], workdir).datamodule.config
        result = {"dataset": "movielens-100k", "path": args.path, "split": args.split, "config": str(config),
                  "val_holdout": data_config.effective_val_holdout}
        start = time.perf_counter()
        result["baselines"] = _baselines_movielens(data_config)
        if args.sequence:
            result["baselines"].update(_baselines_history(data_config, args.history))
            result["history"] = args.history
        result["baselines"]["seconds"] = round(time.perf_counter() - start, 1)
    result["seeds"] = args.seeds
    result["configs"] = {name: str(config) for name, (config, _) in models.items()}
    result["runs"] = {name: [_train_in_subprocess(config, overrides, seed, workdir) for seed in args.seeds] for name, (config, overrides) in models.items()}
    result["mean"] = {name: _mean_over_seeds(runs) for name, runs in result["runs"].items()}
    if "sequence" in result["mean"]:
        result["sequence_auc_gain"] = result["mean"]["sequence"]["auc"] - result["mean"]["dlrm"]["auc"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", help="MovieLens-100k directory (u.user, u.item, u1.base, u1.test)")
    parser.add_argument("--split", default="u1")
    parser.add_argument("--config", type=Path, default=None, help="default: the shipped movielens_dlrm.yaml / criteo_dlrm.yaml")
    parser.add_argument("--criteo-path", help="directory of TorchRec npy Criteo files")
    parser.add_argument("--train-days", type=int, nargs="+", default=[0])
    parser.add_argument("--val-days", type=int, nargs="+", default=[1])
    parser.add_argument("--test-days", type=int, nargs="+", default=[2])
    parser.add_argument("--criteo-table-size", type=int, default=None, help="override data.table_sizes")
    parser.add_argument("--make-synthetic", type=Path, help="write a synthetic MovieLens-format directory here and exit")
    parser.add_argument("--synthetic-ratings", type=int, default=100_000, help="ratings of --make-synthetic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baselines-only", action="store_true")
    parser.add_argument("--json", type=Path, default=RESULTS / "quality.json")
    parser.add_argument("--sequence", action="store_true", help="also train the sequence config on the same split, with the history-aware baselines")
    parser.add_argument("--synthetic-sequence", action="store_true", help="the sequence config against the DLRM on SyntheticSequenceDataModule")
    parser.add_argument("--history", choices=("train", "all_earlier"), default="train",
                        help="the sequence DataModule's history option; all_earlier (split time): served-time histories in val and test")
    parser.add_argument("--sequence-config", type=Path, default=None, help="default: the shipped movielens_sequence.yaml / synthetic_sequence.yaml")
    parser.add_argument("--sequence-override", default="", help="CLI arguments for the sequence config, one quoted string")
    parser.add_argument("--data-override", default="", help="CLI arguments for both configs' data, one quoted string")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="train each model once per seed; report the mean (default: --seed)")
    parser.add_argument("--train-only", type=Path, default=None, help=argparse.SUPPRESS)  # one fit of this config (a _compare child)
    parser.add_argument("--pretrain-path", help="a BERT4Rec-format sequence file: train beauty_pretrain.yaml (or --pretrain-config) on it")
    parser.add_argument("--synthetic-pretrain", action="store_true", help="train synthetic_pretrain.yaml (or --pretrain-config)")
    parser.add_argument("--pretrain-config", type=Path, default=None, help="default: beauty_pretrain.yaml / synthetic_pretrain.yaml")
    parser.add_argument("--parallel-seeds", action="store_true", help="run the pretraining seeds' fits at the same time")
    parser.add_argument("--pretrain-override", default="", help="CLI arguments for the pretraining config, one quoted string")
    parser.add_argument("--override", nargs=argparse.REMAINDER, default=[], help="CLI arguments passed on to the (DLRM) config (last)")
    args = parser.parse_args(argv)

    if args.make_synthetic:
        make_synthetic_movielens(args.make_synthetic, seed=args.seed, num_ratings=args.synthetic_ratings)
        print(f"synthetic MovieLens-100k-format data in {args.make_synthetic}")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="quality-"))
    if args.train_only:
        result = {"model": _train(_build(args.train_only, [*args.override, "--seed_everything", str(args.seed)], workdir))}
        if result["model"]["rank"] == 0:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    if args.pretrain_path or args.synthetic_pretrain:
        return _pretrain(args, workdir)
    if args.synthetic_sequence or args.sequence or args.seeds is not None:
        if not args.synthetic_sequence and not args.path:
            parser.error("--sequence and --seeds need --path (MovieLens-100k), or use --synthetic-sequence")
        args.seeds = args.seeds or [args.seed]
        result = _compare(args, workdir)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        _print_comparison(result)
        print(f"JSON: {args.json}")
        return 0
    if bool(args.path) == bool(args.criteo_path):
        parser.error("give --path (MovieLens-100k) or --criteo-path (npy Criteo files)")

    if args.path:
        config = args.config or CONFIGS / "movielens_dlrm.yaml"
        cli = _build(config, ["--data.path", args.path, "--data.split", args.split, *args.override, "--seed_everything", str(args.seed)], workdir)
        data_config = cli.datamodule.config
        result = {"dataset": "movielens-100k", "path": args.path, "split": args.split, "config": str(config),
                  "val_holdout": data_config.effective_val_holdout}
        start = time.perf_counter()
        result["baselines"] = _baselines_movielens(data_config)
        result["baselines"]["seconds"] = round(time.perf_counter() - start, 1)
    else:
        config_in = args.config or CONFIGS / "criteo_dlrm.yaml"
        result = {"dataset": "criteo-npy", "path": args.criteo_path, "days": [args.train_days, args.val_days, args.test_days]}
        start = time.perf_counter()
        result["baselines"] = _baselines_criteo(args.criteo_path, args.train_days, args.val_days, args.test_days)
        result["baselines"]["seconds"] = round(time.perf_counter() - start, 1)
        config = config_in
        result["config"] = f"{config_in} (data: CriteoBinaryDataModule)"
        overrides = [
            "--data", "lightning_recsys.data.CriteoBinaryDataModule", "--data.path", args.criteo_path, "--data.train_days", json.dumps(args.train_days),
            "--data.val_days", json.dumps(args.val_days), "--data.test_days", json.dumps(args.test_days),
        ]
        if args.criteo_table_size:  # the config's interpolation is resolved before these overrides: set both
            size = str(args.criteo_table_size)
            overrides += ["--data.table_sizes", size, "--model.init_args.table_sizes", json.dumps([int(size)] * 26)]
        overrides += args.override
        cli = None if args.baselines_only else _build(config, [*overrides, "--seed_everything", str(args.seed)], workdir)
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if not args.baselines_only:
        result["model"] = _train(cli)
        rank = result["model"]["rank"]
    if rank != 0:
        return 0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"JSON: {args.json}")
    return 0


def _pretrain(args: argparse.Namespace, workdir: Path) -> int:
    """--pretrain-path / --synthetic-pretrain: the pretraining config over the seeds, beside most-popular."""
    import _pretrain_quality

    default = "synthetic_pretrain.yaml" if args.synthetic_pretrain else "beauty_pretrain.yaml"
    config = args.pretrain_config or CONFIGS / default
    overrides = [*(["--data.path", str(Path(args.pretrain_path).resolve())] if args.pretrain_path else []), *shlex.split(args.pretrain_override)]
    datamodule = _build(config, overrides, workdir).datamodule

    def train(config: Path, overrides: list[str], seed: int) -> dict:
        seed_dir = workdir / f"seed-{seed}"  # each fit's checkpoints apart: the seeds may run at once
        seed_dir.mkdir()
        return _train_in_subprocess(config, overrides, seed, seed_dir)

    result = _pretrain_quality.compare(config, overrides, args.seeds or [args.seed], datamodule, train, parallel=args.parallel_seeds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    _pretrain_quality.print_comparison(result)
    print(f"JSON: {args.json}")
    return 0


def _print(result: dict) -> None:
    rows = [(name, b["test_auc"], b["test_ne"], f"strength {b['strength']}" + (f", {b['feature']}" if "feature" in b else ""))
            for name, b in result["baselines"].items() if isinstance(b, dict) and "test_auc" in b]
    if "model" in result:
        m = result["model"]
        rows.insert(0, ("model", m["test"].get("test/auc", math.nan), m["test"].get("test/ne", math.nan),
                        f"{m['epochs_run']} epochs, fit {m['fit_seconds']} s, {m['world_size']} processes"))
    print(f"\n{result['dataset']} ({result['path']}), config {result['config']}")
    if result["dataset"] == "movielens-100k":
        sizes = result["baselines"]["ratings"]
        split = (f"split {result['split']}: train {sizes['train']}, val {sizes['val']} ({_HOLDOUT_WORDS[result['val_holdout']]} of the base file), "
                 f"test {sizes['test']} ratings")
    else:
        sizes = result["baselines"]["examples"]
        split = f"days train/val/test {result['days']}: {sizes['train']} / {sizes['val']} / {sizes['test']} examples"
    print(f"{split}; baselines fit and scored in {result['baselines']['seconds']} s")
    print(f"{'':<16}{'test AUC':>10}{'test NE':>10}  notes")
    for name, test_auc, test_ne, notes in rows:
        print(f"{name:<16}{test_auc:>10.4f}{test_ne:>10.4f}  {notes}")


def _print_comparison(result: dict) -> None:
    seeds = result["seeds"]
    print(f"\n{result['dataset']}" + (f" ({result['path']}, split {result['split']})" if result["path"] else "") + f", seeds {seeds}")
    print(f"{'':<18}{'test AUC':>10}{'test NE':>10}{'logloss':>10}  notes")
    for name, stats in result["mean"].items():
        runs = result["runs"][name]
        notes = f"{result['configs'][name]}; mean of {len(runs)} (AUC std {stats['auc_std']:.4f}); fit {np.mean([r['fit_seconds'] for r in runs]):.0f} s, {runs[0]['world_size']} processes"
        print(f"{name:<18}{stats['auc']:>10.4f}{stats['ne']:>10.4f}{stats['logloss']:>10.4f}  {notes}")
    for name, b in result["baselines"].items():
        if isinstance(b, dict) and "test_auc" in b:
            knobs = ", ".join(f"{k} {b[k]}" for k in ("window", "strength") if k in b)
            print(f"{name:<18}{b['test_auc']:>10.4f}{b['test_ne']:>10.4f}{b.get('test_logloss', math.nan):>10.4f}  {knobs} (picked on val)")
    if "planted_logit_auc" in result["baselines"]:
        b = result["baselines"]
        print(f"planted logit AUC {b['planted_logit_auc']:.4f} (the ceiling), its non-history part {b['context_only_auc']:.4f}")
    if "empty_history_share" in result["baselines"]:
        print(f"empty histories ({result.get('history', 'train')}): " + ", ".join(f"{s} {v:.1%}" for s, v in result["baselines"]["empty_history_share"].items()))
    if "sequence_auc_gain" in result:
        print(f"sequence - dlrm test AUC: {result['sequence_auc_gain']:+.4f}")


if __name__ == "__main__":
    sys.exit(main())
