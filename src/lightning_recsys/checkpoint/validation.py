"""Comparing a checkpoint's DCP metadata with the state it is about to be loaded into, before any I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_recsys.checkpoint.table_state import (
    NAMESPACE,
    STEP,
    EmbeddingOptimizerState,
    accepted_shapes,
    state_key,
    table_name,
)

MODEL_NAMESPACE = "model"

# Each kind of mismatch has its own remedy; the error lists only those of the kinds it found.
_RESIZED_TABLE = "resized_table"
_RESIZED = "resized"
_MISSING_TABLE = "missing_table"
_ONE_SIDE = "one_side"
_OPTIMIZER = "optimizer"
_RETYPED = "retyped"
_ADVICE = {
    _RETYPED: (
        "a tensor of another dtype: build the model with the dtypes it had when the checkpoint was saved (a load never "
        "converts, so a crafted index cannot make it allocate or cast tensors of another size)."
    ),
    _RESIZED_TABLE: (
        "a resized table: build it with the num_embeddings and embedding_dim (EmbeddingBagConfig) it had when the "
        "checkpoint was saved, the checkpoint's shape above; strict=False does not skip a resized table."
    ),
    _RESIZED: (
        "a resized layer: build the model with the layer sizes it had when the checkpoint was saved, the checkpoint's "
        "shape above; strict=False does not skip a shape mismatch."
    ),
    _MISSING_TABLE: (
        "a missing table: give it the EmbeddingBagConfig name it had when the checkpoint was saved, or pass "
        "strict=False to load the rest and keep it as initialized."
    ),
    _ONE_SIDE: (
        "a key on one side only: build the model with the modules it had when the checkpoint was saved, or pass "
        "strict=False to skip keys that exist on one side only."
    ),
}


class CheckpointMismatchError(ValueError):
    """The checkpoint's keys or global shapes do not match the state it is being loaded into.

    ``kinds``: the kinds of mismatch found, so callers can give only the remedies that apply.
    """

    def __init__(self, message: str, kinds: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.kinds = frozenset(kinds)

    @property
    def strict_false_skips(self) -> bool:
        """Whether ``strict=False`` would skip a mismatch found (a key or table on one side only)."""
        return bool(self.kinds & {_ONE_SIDE, _MISSING_TABLE})

    @property
    def optimizer_state(self) -> bool:
        """Whether embedding optimizer state is missing (``strict=False`` does not skip it)."""
        return _OPTIMIZER in self.kinds


@dataclass(frozen=True, kw_only=True)
class ExpectedEntry:
    """One key the target state wants from the checkpoint.

    Args:
        key: the DCP key, ``model.<state dict key>`` or ``embedding_optimizer.<weight key>.<state>``.
        shapes: the accepted global shapes; None for a non-tensor value.
        table: the embedding table's weight key when the entry belongs to a table, for messages.
        optional: absent from the checkpoint is fine (e.g. the ``step`` of a data-parallel table).
        dtype: the dtype the checkpoint must declare; None: any (the optimizer states, checked by shape).
    """

    key: str
    shapes: tuple[tuple[int, ...], ...] | None
    table: str | None = None
    optional: bool = False
    dtype: torch.dtype | None = None


def model_key(key: str) -> str:
    return f"{MODEL_NAMESPACE}.{key}"


def saved_tensors(metadata: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """key -> (global shape, dtype) of every tensor in the checkpoint."""
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _saved_roots(metadata: Metadata) -> dict[str, object]:
    """The checkpoint's state-dict keys: a nested value (a module's extra state dict), which DCP saves
    flattened into one index key per item, counts once under its own key (DCP's planner_data keeps its path)."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    roots: dict[str, object] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = paths.get(key, (key,))
        roots.setdefault(str(path[0]) if len(path) > 1 else key, item)
    return roots


def check_entries(
    expected: Sequence[ExpectedEntry],
    metadata: Metadata,
    *,
    path: Path,
    strict: bool,
    optimizer_name: str | None,
    saved_optimizer: Mapping[str, object] | None,
) -> list[ExpectedEntry]:
    """Raise ``CheckpointMismatchError`` listing every mismatch; return the entries to load.

    With ``strict=False`` entries missing from the checkpoint are dropped and keys the model lacks
    are ignored; a shape mismatch is an error either way.
    """
    saved = _saved_roots(metadata)
    shapes = saved_tensors(metadata)
    problems: list[str] = []
    kinds: list[str] = []  # of each problem, for the advice
    reported_tables: set[str] = set()
    expected_keys = {e.key for e in expected}
    unexpected_model = {k: shapes.get(k) for k in saved if k.startswith(MODEL_NAMESPACE + ".") and k not in expected_keys}

    to_load: list[ExpectedEntry] = []
    for entry in expected:
        label = _label(entry)
        if entry.key not in saved:
            if entry.optional:
                continue
            if entry.table is not None and entry.table in reported_tables:
                continue
            if entry.key.startswith(NAMESPACE + "."):
                problems.append(_missing_optimizer_state(entry, shapes, optimizer_name, saved_optimizer))
                kinds.append(_OPTIMIZER)
                if entry.table is not None:
                    reported_tables.add(entry.table)
                continue
            if not strict:
                if entry.table is not None:
                    reported_tables.add(entry.table)  # skip the table's optimizer state too
                continue
            want = _shape_text(entry.shapes)
            hint = _rename_hint(entry, unexpected_model)
            problems.append(f"{label} (expected shape {want}) is not in the checkpoint{hint}.")
            kinds.append(_ONE_SIDE if entry.table is None else _MISSING_TABLE)
            if entry.table is not None:
                reported_tables.add(entry.table)
            continue
        if entry.shapes is not None:
            got = shapes.get(entry.key)
            if got is None or got[0] not in entry.shapes:
                if entry.table is not None and entry.table in reported_tables:
                    continue
                saved_shape = "a non-tensor value" if got is None else str(got[0])
                problems.append(
                    f"{label}: the checkpoint has shape {saved_shape}, the model expects {_shape_text(entry.shapes)}."
                )
                kinds.append(_RESIZED if entry.table is None else _RESIZED_TABLE)
                if entry.table is not None:
                    reported_tables.add(entry.table)
                continue
            if entry.dtype is not None and got[1] != entry.dtype:
                problems.append(f"{label}: the checkpoint declares dtype {got[1]}, the model holds {entry.dtype}.")
                kinds.append(_RETYPED)
                continue
        to_load.append(entry)
    if strict:
        for key, got in sorted(unexpected_model.items()):
            shape = "" if got is None else f" (shape {got[0]})"
            problems.append(f"'{key}'{shape} is in the checkpoint but not in the model.")
            kinds.append(_ONE_SIDE)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointMismatchError(
            f"checkpoint {str(path)!r} does not match the state it is being loaded into "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}\n"
            f"{_how_to_fix(kinds, optimizer_name, saved_optimizer)}",
            kinds,
        )
    return to_load


def _how_to_fix(kinds: Sequence[str], optimizer_name: str | None, saved_optimizer: Mapping[str, object] | None) -> str:
    """One remedy per kind of mismatch found, in the order they were found."""
    advice: list[str] = []
    for kind in dict.fromkeys(kinds):
        if kind == _OPTIMIZER:
            advice.append(_optimizer_advice(optimizer_name, saved_optimizer))
        else:
            advice.append(_ADVICE[kind])
    return "How to fix:\n" + "\n".join(f"  * {a}" for a in advice)


def _optimizer_advice(optimizer_name: str | None, saved_optimizer: Mapping[str, object] | None) -> str:
    saved_name = (saved_optimizer or {}).get("name")
    fresh = "pass load_embedding_optimizer_state=False to start the embedding optimizer fresh (strict=False does not skip it)."
    if saved_name is None or saved_name == optimizer_name:
        # Same optimizer: switching would not help; the state was not saved for these tables.
        return f"missing embedding optimizer state: {fresh}"
    return (
        f"another embedding optimizer: use EmbeddingOptimizerConfig(name={saved_name!r}), the one the checkpoint "
        f"was saved with, or {fresh}"
    )


def _label(entry: ExpectedEntry) -> str:
    if entry.table is not None and entry.key == model_key(entry.table):
        return f"table {table_name(entry.table)!r} ('{entry.key}')"
    if entry.table is not None:
        return f"the embedding optimizer state of table {table_name(entry.table)!r} ('{entry.key}')"
    return f"'{entry.key}'"


def _shape_text(shapes: tuple[tuple[int, ...], ...] | None) -> str:
    if shapes is None:
        return "a non-tensor value"
    return " or ".join(str(s) for s in shapes)


def _rename_hint(entry: ExpectedEntry, unexpected: Mapping[str, tuple[tuple[int, ...], torch.dtype] | None]) -> str:
    if entry.shapes is None:
        return ""
    same_shape = [k for k, got in unexpected.items() if got is not None and got[0] in entry.shapes]
    if not same_shape:
        return ""
    return f"; the checkpoint has {', '.join(repr(k) for k in sorted(same_shape))} with that shape instead: was it renamed?"


def _missing_optimizer_state(
    entry: ExpectedEntry,
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    optimizer_name: str | None,
    saved_optimizer: Mapping[str, object] | None,
) -> str:
    prefix = f"{NAMESPACE}.{entry.table}."
    has = sorted(k.removeprefix(prefix) for k in shapes if k.startswith(prefix))
    saved_name = (saved_optimizer or {}).get("name")
    return (
        f"{_label(entry)} is not in the checkpoint: it holds {has or 'no state'} for this table (saved with "
        f"embedding optimizer {saved_name!r}), the model's optimizer {optimizer_name!r} needs "
        f"'{entry.key.removeprefix(prefix)}'."
    )


def model_entries(model_state_dict: Mapping[str, Any], tables: set[str]) -> list[ExpectedEntry]:
    """What a model's state dict expects to find in a checkpoint: each key, its shape, whether it is a table."""
    entries = []
    for key, value in model_state_dict.items():
        tensor = isinstance(value, torch.Tensor)
        shapes = (tuple(value.size()),) if tensor else None
        entries.append(
            ExpectedEntry(key=model_key(key), shapes=shapes, table=key if key in tables else None, dtype=value.dtype if tensor else None)
        )
    return entries


def optimizer_entries(optimizer_state: EmbeddingOptimizerState) -> list[ExpectedEntry]:
    """What the tables' fused optimizer state expects: each state of each table (and Adam's optional step)."""
    entries = []
    for key, placement in optimizer_state.tables.items():
        for state in optimizer_state.states:
            entries.append(
                ExpectedEntry(key=state_key(key, state), shapes=accepted_shapes(state, placement.rows, placement.dim), table=key)
            )
        if placement.shards is None and optimizer_state.states:
            entries.append(ExpectedEntry(key=state_key(key, STEP), shapes=((),), table=key, optional=True))
    return entries
