"""What the DataModule knows and the model reads, carried by ``LightningCLI.link_arguments``: no config writes it twice.

A link applies when the configured DataModule has the attribute and the configured model takes the
argument; otherwise jsonargparse skips it (a DLRM on click logs has neither). The value is read from
the DataModule once it is built (``apply_on="instantiate"``), so a count that needs the data (the
largest item id of a sequence file, a prepared directory's vocabulary) comes from the data itself.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser

# (DataModule attribute, model argument)
DATA_TO_MODEL_LINKS: tuple[tuple[str, str], ...] = (
    ("num_items", "num_items"),  # rows of the item table (SequencePretrainer)
    ("max_length", "max_length"),  # newest items of a sequence the encoder reads (SequencePretrainer)
    ("num_items", "item_table_size"),  # rows of the item table (SequenceRanker, on sequence files or parquet)
    ("item_table_size", "item_table_size"),  # the same, from the DataModules of clicks with histories
    ("num_action_types", "num_action_types"),  # rows of the action-type table
)


def add_data_links(parser: LightningArgumentParser) -> None:
    for attribute, argument in DATA_TO_MODEL_LINKS:
        parser.link_arguments(f"data.{attribute}", f"model.init_args.{argument}", apply_on="instantiate")


def linked_model_arguments(datamodule: object, model_class: type, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` plus what the links carry from ``datamodule`` to ``model_class``, for code that builds the two
    without the CLI (benchmarks, notebooks); a given value that disagrees with the data's is an error."""
    parameters = inspect.signature(model_class).parameters
    conflicts = link_conflicts({k: v for k, v in given.items() if v is not None}, datamodule)
    if conflicts:
        raise ValueError("\n".join(conflicts))
    linked = dict(given)
    for attribute, argument in DATA_TO_MODEL_LINKS:
        if argument in parameters and getattr(datamodule, attribute, None) is not None:
            linked[argument] = getattr(datamodule, attribute)
    return linked


def configured_link_targets(config: Namespace) -> dict[str, Any]:
    """The linked model arguments that the config sets to something other than the model's default."""
    model = config.get("model")
    if not isinstance(model, Namespace) or not model.get("class_path"):
        return {}
    module_name, _, class_name = str(model.class_path).rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module_name), class_name)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}  # jsonargparse reports an unknown class itself
    init_args = model.get("init_args") or Namespace()
    given = {}
    for _, argument in DATA_TO_MODEL_LINKS:
        value = init_args.get(argument)
        if argument in parameters and value is not None and value != parameters[argument].default:
            given[argument] = value
    return given


def link_conflicts(given: dict[str, Any], datamodule: object) -> list[str]:
    """Each model argument the config set that disagrees with the DataModule's value the link put there instead."""
    problems = []
    for attribute, argument in DATA_TO_MODEL_LINKS:
        if argument in given and hasattr(datamodule, attribute):
            linked = getattr(datamodule, attribute)
            if linked is not None and linked != given[argument]:
                problems.append(
                    f"model.init_args.{argument}={given[argument]!r} disagrees with the data's {attribute}={linked!r}. The CLI "
                    f"links {argument} from the DataModule ({type(datamodule).__name__}.{attribute}): remove it from the model "
                    f"section, or set it on the data."
                )
    return problems
