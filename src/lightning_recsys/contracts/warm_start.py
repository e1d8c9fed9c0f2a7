"""Warm-start roles: the parts of a model another model can start from, named by role rather than by attribute.

A model that implements ``WarmStartable`` says where each role lives in its own ``state_dict``
(``WarmStartPart.prefix``) and what it is (``WarmStartPart.kind``: the encoder's class, or the table's
kind). It also records that map in each checkpoint it saves (``WARM_START_PARTS_KEY``), so a warm start
(``lightning_recsys.callbacks.InitFromCheckpoint(parts=[...])``) copies "the encoder" and "the item table"
from a checkpoint whose attributes are named differently, and says which part differs and how when
one does not fit (missing in the checkpoint or the model, another kind of encoder, other shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ENCODER_ROLE", "ITEM_TABLE_ROLE", "WARM_START_PARTS_KEY", "WARM_START_ROLES", "WarmStartPart", "WarmStartable",
    "parts_from_record", "parts_record",
]

ENCODER_ROLE = "encoder"  # the sequence encoder (a SequenceEncoder module)
ITEM_TABLE_ROLE = "item_table"  # the item embedding table (contracts.names.ITEM_TABLE)
WARM_START_ROLES: tuple[str, ...] = (ENCODER_ROLE, ITEM_TABLE_ROLE)
WARM_START_PARTS_KEY = "lightning_recsys_warm_start_parts"  # a checkpoint's record of its model's parts


@dataclass(frozen=True)
class WarmStartPart:
    """One role of a model: its ``state_dict`` key prefix (ending in ``"."``) and its kind.

    ``kind``: for the encoder its class (``module.QualName``), for a table ``"table"``; two parts of one
    role fit when their kinds are equal and every tensor under the prefixes has the same relative name and shape.
    """

    prefix: str
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix.endswith("."):
            raise ValueError(f"WarmStartPart(prefix={self.prefix!r}) must be a state_dict key prefix ending in '.', e.g. 'encoder.'.")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"WarmStartPart(kind={self.kind!r}) must be a non-empty string (the encoder's class, or 'table').")


@runtime_checkable
class WarmStartable(Protocol):
    """A model whose parts a warm start finds by role: ``warm_start_parts()`` -> role -> ``WarmStartPart``."""

    def warm_start_parts(self) -> Mapping[str, WarmStartPart]:
        ...


def parts_record(parts: Mapping[str, WarmStartPart]) -> dict[str, dict[str, str]]:
    """The parts as plain data, for a checkpoint (readable with ``torch.load(weights_only=True)``)."""
    return {role: {"prefix": part.prefix, "kind": part.kind} for role, part in parts.items()}


def parts_from_record(record: Any) -> dict[str, WarmStartPart] | None:
    """``parts_record``'s inverse; None for a record that is absent or not of that form."""
    if not isinstance(record, Mapping):
        return None
    try:
        return {str(role): WarmStartPart(prefix=entry["prefix"], kind=entry["kind"]) for role, entry in record.items()}
    except (KeyError, TypeError, ValueError):
        return None
