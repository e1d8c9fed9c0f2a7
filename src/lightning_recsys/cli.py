"""The ``lightning-recsys`` console script: Lightning's CLI for fit, validate, test and predict.

    lightning-recsys fit --config examples/configs/synthetic_dlrm.yaml
    lightning-recsys fit --config examples/configs/movielens_dlrm.yaml --data.path data/ml-100k
    lightning-recsys fit --config examples/configs/synthetic_dlrm.yaml --print_config
    lightning-recsys plan --config examples/configs/synthetic_dlrm.yaml --world-size 16 --sharding-group-size 8

Configs are read in jsonargparse's omegaconf mode, so ``${...}`` interpolation works in YAML. The
strategy can be written ``strategy: twod_rec`` or with ``class_path``/``init_args``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lightning_recsys  # noqa: F401 - registers "twod_rec" for Trainer(strategy=...)
from lightning_recsys.callbacks import RunSummary


class RecSysCLI(LightningCLI):
    """LightningCLI with omegaconf interpolation, CSV logging and a run summary at the end of fit."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--summary-json", "--summary_json", type=Optional[str], default=None, help="Also write the run summary to this JSON file (fit)."
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = config["trainer"].get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        # A Rich progress bar unless the config chose another or turned it off.
        if config["trainer"].get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RichProgressBar())
        if self.subcommand == "fit":
            callbacks.append(RunSummary(json_path=config.get("summary_json")))
        if config["trainer"].get("logger") in (None, True):
            # Lightning's default logger, but CSV whether or not tensorboard is installed; it writes under
            # trainer.default_root_dir as Lightning's own default does (the working directory if unset).
            root = config["trainer"].get("default_root_dir") or os.getcwd()
            kwargs["logger"] = CSVLogger(save_dir=root)
        return super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})


def build_cli(args: Optional[list[str]] = None, run: bool = True) -> RecSysCLI:
    """The CLI on ``args`` (default: ``sys.argv``); ``run=False`` builds the objects without running."""
    return RecSysCLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: Optional[list[str]] = None) -> None:
    """The ``lightning-recsys`` console script; ``lightning-recsys plan ...`` prints a plan report."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plan"]:
        from lightning_recsys.plan_cli import plan_main

        raise SystemExit(plan_main(argv[1:]))
    build_cli(args)


if __name__ == "__main__":
    main()
