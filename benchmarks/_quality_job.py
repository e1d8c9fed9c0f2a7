"""One time-to-quality run for ``time_to_quality.py``: run it under torchrun on every "node".

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr ... --master-port ... \
        benchmarks/_quality_job.py --num-nodes 2 --devices 2 --sharding-group-size 4 --threshold 0.5 --out result.json

Trains the synthetic pretraining config (``examples/configs/synthetic_pretrain.yaml``: ``SequencePretrainer`` on
``SyntheticPretrainDataModule``'s planted item chains; ``--set`` overrides its model and data arguments) with
``TwoDRecStrategy`` under one configuration (``_bench_job.add_strategy_arguments``), validates every ``--eval-every``
steps, and stops at the first validation whose ``val/ndcg@10`` reaches ``--threshold`` (or after ``--max-steps``).
Global rank 0 writes every validation as (step, training seconds, wall seconds, NDCG@10) to ``--out``.

Training seconds run from the first training batch (process groups, the plan and sharding are done by then) to
the validation, less the time spent in validations; wall seconds include the validations. The metric is reduced
over every rank before it is logged, so all ranks stop at the same step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from _bench_job import add_strategy_arguments, qcomms_setting, replica_sync_config

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "synthetic_pretrain.yaml"
METRIC = "val/ndcg@10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result path (written by global rank 0)")
    parser.add_argument("--devices", type=int, default=2, help="ranks per node")
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--config", type=Path, default=CONFIG, help="the pretraining config whose model and data are trained")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override the config: model.NAME or data.NAME (their init_args) or any dotted key it has, e.g. data.num_items=4096",
    )
    parser.add_argument("--threshold", type=float, default=None, help=f"stop at the first validation whose {METRIC} is >= this")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, required=True, help="validate every this many training steps")
    add_strategy_arguments(parser)
    args = parser.parse_args(argv)
    if args.eval_every < 1 or args.max_steps < args.eval_every or args.eval_every % args.sync_every_n_steps:
        parser.error(
            f"--eval-every={args.eval_every} must be >= 1, <= --max-steps={args.max_steps} and a multiple of "
            f"--sync-every-n-steps={args.sync_every_n_steps} (each validation sees synced replicas)."
        )
    return args


def load_config(path: Path, overrides: list[str]) -> dict[str, Any]:
    """The config's ``trainer``, ``model`` and ``data`` sections, interpolations resolved, with ``overrides`` applied first.

    ``model.NAME=VALUE`` and ``data.NAME=VALUE`` set an ``init_args`` entry; any other dotted key must name an entry
    the config has (e.g. ``trainer.strategy.init_args.embedding_optimizer.lr=0.1``). Values are YAML.
    """
    from omegaconf import OmegaConf

    config = OmegaConf.load(path)
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if len(parts) == 2 and parts[0] in ("model", "data"):
            parts.insert(1, "init_args")
        node = config
        for part in parts[:-1]:
            node = node.get(part) if OmegaConf.is_dict(node) else None
        if not sep or len(parts) < 2 or not OmegaConf.is_dict(node) or parts[-1] not in node:
            choices = list(node) if OmegaConf.is_dict(node) else ["model.NAME", "data.NAME"]
            raise ValueError(f"--set {item!r}: {path.name} has no {'.'.join(parts)}; expected KEY=VALUE with a key it has, "
                             f"e.g. model.NAME=VALUE or data.NAME=VALUE (here: {choices})")  # fmt: skip
        node[parts[-1]] = yaml.safe_load(value)
    return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]


def instantiate(section: dict[str, Any], **linked: Any) -> Any:
    module, _, name = section["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**{**section.get("init_args", {}), **linked})


def instantiate_linked(config: dict[str, Any]) -> tuple[Any, Any]:
    """The config's DataModule and model, the model given what the CLI links from the data (num_items, max_length)."""
    from lightning_recsys.cli.links import linked_model_arguments

    data = instantiate(config["data"])
    module, _, name = config["model"]["class_path"].rpartition(".")
    model_class = getattr(importlib.import_module(module), name)
    return data, model_class(**linked_model_arguments(data, model_class, dict(config["model"].get("init_args", {}))))


class QualityClock(pl.Callback):
    """Times training apart from validation and stops the fit once ``METRIC`` reaches the threshold."""

    def __init__(self, threshold: float | None, strategy: Any) -> None:
        self.threshold, self.strategy = threshold, strategy
        self.step_bytes = [0, 0]  # rank 0's training steps' (payload, inter-node) bytes; validation's exchanges are not steps
        self.started: float | None = None
        self.in_validation = 0.0
        self._validation_started = 0.0
        self.points: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        payload, inter = self.strategy.comm_accounting.bytes_by()  # the step just closed
        self.step_bytes[0] += payload
        self.step_bytes[1] += inter

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.started is None:  # a sanity check before training
            return
        now = time.perf_counter()
        self.in_validation += now - self._validation_started
        value = float(trainer.callback_metrics[METRIC])
        wall = now - self.started
        self.points.append({"step": trainer.global_step, "train_s": wall - self.in_validation, "wall_s": wall, "ndcg10": value})
        if self.threshold is not None and value >= self.threshold:
            trainer.should_stop = True


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # 4 ranks share few cores

    from lightning_recsys import EmbeddingOptimizerConfig, TwoDRecStrategy

    config = load_config(args.config, args.set)
    replica_sync = replica_sync_config(args)
    pl.seed_everything(int(config.get("seed_everything", 0)), verbose=False)
    data, model = instantiate_linked(config)
    optimizer = config["trainer"]["strategy"]["init_args"]["embedding_optimizer"]
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(**optimizer),
        sharding_group_size=args.sharding_group_size or args.devices * args.num_nodes,
        layout=args.layout,
        replica_sync=replica_sync,
        qcomms=qcomms_setting(args.qcomms, args.index_dedup),
        process_group_timeout=120.0,  # a stuck peer fails the run instead of hanging it
    )
    clock = QualityClock(args.threshold, strategy)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_steps=args.max_steps,
        max_epochs=-1, val_check_interval=args.eval_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, logger=False, callbacks=[clock],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    if not trainer.is_global_zero:
        return None
    reached = next((p for p in clock.points if args.threshold is not None and p["ndcg10"] >= args.threshold), None)
    result = {
        "threshold": args.threshold, "reached": reached, "points": clock.points, "steps_run": trainer.global_step,
        "global_batch_size": data.global_batch_size,
        "bytes_per_step_rank0": {"total": clock.step_bytes[0] / max(1, trainer.global_step), "inter_node": clock.step_bytes[1] / max(1, trainer.global_step)},
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    where = f"step {reached['step']}, {reached['train_s']:.1f} s of training" if reached else f"not reached in {trainer.global_step} steps"
    print(f"[quality_job] {METRIC} >= {args.threshold}: {where} -> {args.out}")
    return result


if __name__ == "__main__":
    main()
