"""``RecSysCLI``: Lightning's CLI for the Trainer subcommands fit, validate, test and predict.

Configs are read in jsonargparse's omegaconf mode, so ``${...}`` interpolation works in YAML. The
strategy can be written ``strategy: twod_rec`` or with ``class_path``/``init_args``. Its help also
lists the subcommands that ``lightning_recsys.cli.main`` runs itself (``plan``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_warn

from lightning_recsys.callbacks import RunSummary
from lightning_recsys.cli.links import add_data_links, configured_link_targets, link_conflicts

# Subcommands that do not run a Trainer; ``lightning_recsys.cli.main`` dispatches them before parsing.
OTHER_SUBCOMMANDS: dict[str, str] = {
    "plan": "Print the sharding plan report that training with a config logs at setup, without training.",
    "prepare": "Group raw events by user into prepared parquet data (DuckDB, out of core); or describe another engine's.",
}


class RecSysCLI(LightningCLI):
    """LightningCLI with omegaconf interpolation, CSV logging and a run summary at the end of fit."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--summary-json", "--summary_json", type=Optional[str], default=None, help="Also write the run summary to this JSON file (fit)."
        )
        add_data_links(parser)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        subcommands = parser._subcommands_action  # jsonargparse keeps the action add_subcommands() made here
        assert subcommands is not None
        for name, help_text in OTHER_SUBCOMMANDS.items():  # listed in --help; parsed by their own commands
            subcommands.add_subcommand(name, ArgumentParser(description=help_text), help=help_text)

    def instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        given = configured_link_targets(config)
        try:
            super().instantiate_classes()
        except ValueError as error:
            if os.environ.get("JSONARGPARSE_DEBUG"):
                raise
            # jsonargparse reports a constructor's own ValueError (which names the argument, its value and
            # the rule) inside its union-type errors, under a long traceback: print it as a usage error.
            self.parser.error(f"a configured object refused its arguments (JSONARGPARSE_DEBUG=1 shows the traceback):\n{error}")
        conflicts = link_conflicts(given, self.datamodule)
        if conflicts:
            self.parser.error("\n".join(conflicts))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        configured = config["trainer"].get("callbacks") or []
        callbacks = list(configured) if isinstance(configured, list) else [configured]
        # A Rich progress bar unless the config chose another or turned it off.
        if config["trainer"].get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RichProgressBar())
        if self.subcommand == "fit":
            callbacks.append(RunSummary(json_path=config.get("summary_json")))
        elif config.get("summary_json"):
            rank_zero_warn(
                f"--summary-json {config.get('summary_json')} is ignored by {self.subcommand}: the run summary (step times, "
                "bytes per step, final metrics) is written by fit only. The metrics of this run are in the logger's files."
            )
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
