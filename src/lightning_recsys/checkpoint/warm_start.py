"""Warm start: copy chosen weights of another model's checkpoint into a (sharded or unsharded) model, Trainer-free.

The source is a DCP checkpoint directory of this package (``save_checkpoint``, a Trainer's
checkpoint) or a safetensors export of one (``export_safetensors``). Only model tensors are read:
no embedding optimizer state and no host state (step counters, callbacks, dense optimizers; its
``host_state.pt`` is not opened). A DCP index is read as every load of this package reads it.
Keys are the source module's ``state_dict()`` names; ``include`` (``fnmatch`` patterns) picks them
and ``rename`` (key prefixes) maps them onto the target's names. Or ``parts`` picks by role
(``contracts.warm_start``: "the encoder", "the item table"), wherever each model holds it
(``warm_start_parts``), and a part that does not fit is named with how it differs. Every pick is checked against the target (name and global shape) before any
tensor is read. A DCP source is read with DCP itself, each sharding group over its own process
group, so any saving world size and plan loads into any target plan (as ``load_checkpoint``).
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_recsys.checkpoint.dcp_io import ShardedState, _all_ranks_ok, _read_shards
from lightning_recsys.checkpoint.directory import read_meta, resolve
from lightning_recsys.checkpoint.safe_reading import (
    INDEX_FILE,
    CheckpointCorruptError,
    check_storage,
    read_host_state,
    read_index,
)
from lightning_recsys.checkpoint.table_state import table_name
from lightning_recsys.checkpoint.validation import MODEL_NAMESPACE, CheckpointMismatchError, model_key
from lightning_recsys.contracts.warm_start import WARM_START_PARTS_KEY, WarmStartPart, parts_from_record
from lightning_recsys.parallel.sharding import find_embedding_modules
from lightning_recsys.parallel.topology import ParallelTopology

__all__ = ["WarmStartResult", "load_weights", "load_weights_unsharded", "select_weights"]

SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(frozen=True, kw_only=True)
class WarmStartResult:
    """What a warm start loaded.

    Args:
        path: the checkpoint directory (the newest committed copy of its name) or safetensors file.
        loaded: target state-dict key -> the source key it was read from, in the source's order.
        saved_by: the layout that wrote a DCP source (world size, 1D or 2D, each table's sharding), as
            its ``meta.json`` records it; None for a safetensors export, which has none.
    """

    path: Path
    loaded: dict[str, str]
    saved_by: str | None = None


def select_weights(
    source_keys: Sequence[str],
    target_keys: Collection[str],
    *,
    include: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Target key -> source key: the source keys ``include`` matches, renamed by ``rename``; raise ``ValueError`` else.

    ``include``: ``fnmatch`` patterns over the source keys (None: every source key); each must match
    at least one. ``rename``: source key prefix -> target key prefix; the longest matching prefix
    applies. Every picked key, once renamed, must be a target key, and no two may land on one.
    """
    patterns = ["*"] if include is None else list(include)
    renames = dict(rename or {})
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(k, p) for k in source_keys)]
    if unmatched:
        shown = ", ".join(repr(k) for k in list(source_keys)[:8]) + (", ..." if len(source_keys) > 8 else "")
        raise ValueError(
            f"include pattern(s) {unmatched} match no tensor of the checkpoint (fnmatch patterns over its state-dict "
            f"keys, e.g. 'encoder.*'); it holds {len(source_keys)} tensors: {shown or 'none'}."
        )
    picked = [k for k in source_keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for key in picked:
        prefix = max((p for p in renames if key.startswith(p)), key=len, default=None)
        target = key if prefix is None else renames[prefix] + key[len(prefix):]
        if target not in target_keys:
            missing.append(key if target == key else f"{key} (renamed {target})")
            continue
        if target in mapping:
            raise ValueError(f"rename={renames} maps both {mapping[target]!r} and {key!r} onto the model's {target!r}; map each onto its own key.")
        mapping[target] = key
    if missing:
        raise ValueError(
            f"the model has no tensor for {len(missing)} checkpoint key(s) picked by include={patterns}: {missing}. Narrow "
            "include to the tables and submodules the model shares with the checkpoint, or map their names with "
            "rename={'<checkpoint prefix>': '<model prefix>'}."
        )
    return mapping


def load_weights(
    path: str | os.PathLike[str],
    *,
    state: ShardedState,
    topology: ParallelTopology,
    include: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
    trusted: bool = False,
    parts: Mapping[str, WarmStartPart] | None = None,
) -> WarmStartResult:
    """Load the tensors ``include``/``rename`` (or ``parts``) pick from checkpoint ``path`` into a sharded model, in place; collective.

    Every rank calls it. Every rank checks the picks (``select_weights``) and their global shapes
    before anything is read; a problem on any rank raises on every rank (the one that found it
    raises it, the others ``CheckpointError``). Shape mismatches raise ``CheckpointMismatchError``
    naming each table or parameter with both shapes. Only ``state.model_state_dict`` changes; the
    embedding optimizer, dense optimizers and any step counter are left as they are. A DCP source is
    read as every load of this package reads one (``checkpoint.safe_reading``; ``trusted`` as there).
    ``parts``: role -> the model's ``WarmStartPart`` of each role to load (``warm_start_parts()``), in place of
    ``include`` and ``rename``: each is found in the checkpoint by the parts its model recorded.
    """
    tables = set(state.table_placements())
    model_state = state.model_state_dict
    plan: _Plan | None = None
    error: Exception | None = None
    try:
        plan = _plan(path, model_state, tables, include, rename, trusted, parts)
    except Exception as e:  # noqa: BLE001 - every rank must learn about it
        error = e
    _all_ranks_ok(error, action=f"checking warm-start checkpoint {str(path)!r}")
    assert plan is not None
    if plan.is_safetensors:
        error = None
        try:
            _copy_from_safetensors(plan, model_state)
        except Exception as e:  # noqa: BLE001
            error = e
        _all_ranks_ok(error, action=f"reading warm-start file {str(plan.path)!r}")
    else:
        _read_dcp(plan, model_state, trusted=trusted, process_group=topology.sharding_process_group())
    return WarmStartResult(path=plan.path, loaded=dict(plan.mapping), saved_by=plan.saved_by)


def load_weights_unsharded(
    path: str | os.PathLike[str],
    module: nn.Module,
    *,
    include: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
    trusted: bool = False,
    parts: Mapping[str, WarmStartPart] | None = None,
) -> WarmStartResult:
    """``load_weights`` for an unsharded ``module`` in this process, with no process group (real, not meta, storage)."""
    model_state = module.state_dict()
    on_meta = sorted(k for k, v in model_state.items() if isinstance(v, torch.Tensor) and v.is_meta)
    if on_meta:
        raise ValueError(f"{type(module).__name__} has tensors on the meta device ({on_meta[:3]}...), which cannot hold loaded values.")
    tables = {f"{fqn}.{k}" if fqn else k for fqn, sub in find_embedding_modules(module).items() for k in sub.state_dict()}
    plan = _plan(path, model_state, tables, include, rename, trusted, parts)
    if plan.is_safetensors:
        _copy_from_safetensors(plan, model_state)
    else:
        _read_dcp(plan, model_state, trusted=trusted, no_dist=True)
    # In case a module's state_dict() returns copies rather than views of its storage.
    module.load_state_dict({t: model_state[t] for t in plan.mapping}, strict=False)
    return WarmStartResult(path=plan.path, loaded=dict(plan.mapping), saved_by=plan.saved_by)


@dataclass(frozen=True)
class _Plan:
    path: Path
    is_safetensors: bool
    mapping: dict[str, str]  # target key -> source key
    saved_by: str | None = None
    metadata: Metadata | None = None  # the DCP index read and checked while planning, handed to DCP as it is


def _saved_by(meta: Any) -> str:
    """``meta.json``'s topology and table shardings in one phrase, e.g. "4 ranks, 2D: 2 replicas x sharding groups of 2; item row_wise"."""
    layout = "1D" if meta.num_replicas == 1 else f"2D: {meta.num_replicas} replicas x sharding groups of {meta.sharding_group_size}"
    tables = ", ".join(f"{entry['table']} {entry['sharding_type']}" for entry in meta.tables.values())
    return f"{meta.world_size} ranks, {layout}" + (f"; {tables}" if tables else "")


def _plan(
    path: str | os.PathLike[str],
    model_state: Mapping[str, Any],
    tables: set[str],
    include: Sequence[str] | None,
    rename: Mapping[str, str] | None,
    trusted: bool,
    parts: Mapping[str, WarmStartPart] | None = None,
) -> _Plan:
    """Read the source's index (no tensor), pick and rename its keys, and check them against the model."""
    target_keys = {k for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    if Path(path).suffix == SAFETENSORS_SUFFIX:
        file = Path(path)
        try:
            mode = file.stat().st_mode
        except FileNotFoundError:
            raise FileNotFoundError(f"warm-start file {str(file)!r} does not exist (a safetensors export, export_safetensors()).") from None
        if not stat.S_ISREG(mode):  # a FIFO would block the reader: refused before it is opened
            raise CheckpointCorruptError(f"warm-start file {str(file)!r} is not a regular file; give a safetensors export (export_safetensors()).")
        with safe_open(str(file), framework="pt") as reader:
            saved = {k: tuple(reader.get_slice(k).get_shape()) for k in reader.keys()}  # noqa: SIM118 - safe_open has no __iter__
        source, saved_by, source_parts, metadata = file, None, None, None
    else:
        source = resolve(path)  # the newest committed copy of this name; refuses uncommitted and foreign directories
        saved_by = _saved_by(read_meta(source))
        metadata = read_index(source / INDEX_FILE, trusted=trusted)
        check_storage(metadata, source)  # every shard file against the index, before anything is read
        prefix = MODEL_NAMESPACE + "."
        saved = {
            k.removeprefix(prefix): tuple(md.size)
            for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
        }
        source_parts = _recorded_parts(source) if parts is not None else None
    roles: dict[str, str] = {}
    if parts is not None:
        include, rename, roles = parts_selection(str(source), parts, source_parts, list(saved), target_keys)
    mapping = select_weights(list(saved), target_keys, include=include, rename=rename)
    _check_shapes(source, mapping, saved, model_state, tables, roles)
    return _Plan(path=source, is_safetensors=source.suffix == SAFETENSORS_SUFFIX, mapping=mapping, saved_by=saved_by, metadata=metadata)


def _check_shapes(
    source: Path,
    mapping: Mapping[str, str],
    saved: Mapping[str, tuple[int, ...]],
    model_state: Mapping[str, Any],
    tables: set[str],
    roles: Mapping[str, str] | None = None,
) -> None:
    """``CheckpointMismatchError`` naming every picked table/parameter whose saved global shape is not the model's."""
    problems = []
    for target, key in mapping.items():
        want = tuple(model_state[target].size())  # a ShardedTensor's size() is its global shape
        if saved[key] != want:
            kind = f"table {table_name(target)!r}" if target in tables else "parameter"
            renamed = "" if target == key else f" (loaded into the model's {target!r})"
            role = next((f"the {r!r} part's " for prefix, r in (roles or {}).items() if target.startswith(prefix)), "")
            problems.append(f"{role}{kind} {key!r}{renamed}: the checkpoint has shape {saved[key]}, the model has {want}.")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointMismatchError(
            f"warm start from {str(source)!r}: {len(problems)} picked tensor(s) differ in shape from the model's:\n{lines}\n"
            "Build the model with the checkpoint's sizes (num_embeddings, embedding_dim, layer widths), or leave these "
            "tensors out of include so they keep their initial values.",
            ("resized",),
        )


def _read_dcp(plan: _Plan, model_state: Mapping[str, Any], *, trusted: bool, **kwargs: Any) -> None:
    """DCP reads the source keys straight into the target tensors (re-cut for this plan), through the safe reader."""
    targets = {model_key(source): model_state[target] for target, source in plan.mapping.items()}
    _read_shards(targets, plan.path, trusted=trusted, metadata=plan.metadata, **kwargs)


def _copy_from_safetensors(plan: _Plan, model_state: Mapping[str, Any]) -> None:
    """Each target tensor (or this rank's shards of it) gets its slice of the whole saved tensor."""
    with safe_open(str(plan.path), framework="pt") as reader:
        for target, source in plan.mapping.items():
            value = model_state[target]
            saved = reader.get_slice(source)
            with torch.no_grad():
                if isinstance(value, ShardedTensor):
                    for shard in value.local_shards():
                        rows, cols = shard.metadata.shard_offsets
                        height, width = shard.metadata.shard_sizes
                        shard.tensor.copy_(saved[rows : rows + height, cols : cols + width])
                elif type(value) in (torch.Tensor, nn.Parameter):  # not a DTensor or other subclass: whole on every rank
                    value.copy_(reader.get_tensor(source))
                else:
                    raise TypeError(
                        f"the model's {target!r} is a {type(value).__name__}; a safetensors warm start fills tensors and "
                        "ShardedTensors. Warm-start from the DCP checkpoint directory instead."
                    )


def _recorded_parts(directory: Path) -> dict[str, WarmStartPart] | None:
    """The warm-start parts the checkpoint's model recorded (``contracts.warm_start``), or None.

    Read from its host state with ``torch.load(weights_only=True)``: plain data only, no code runs. A
    checkpoint without the record (older, or of a model without parts) or whose host state holds more than
    plain data gives None, and the model's own prefixes are assumed.
    """
    try:
        host_state = read_host_state(directory, weights_only=True)
    except Exception:  # noqa: BLE001 - the record is optional; the key checks below still speak
        return None
    return parts_from_record((host_state or {}).get(WARM_START_PARTS_KEY))


def parts_selection(
    source: str,
    parts: Mapping[str, WarmStartPart],
    source_parts: Mapping[str, WarmStartPart] | None,
    source_keys: Sequence[str],
    target_keys: Collection[str],
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """``(include, rename, target prefix -> role)`` that load each role of ``parts`` from the checkpoint's part of that role.

    ``source_parts``: the checkpoint's record (None: assume each part sits where the model holds it). Raises
    ``ValueError`` where a role is missing from the checkpoint or holds other tensors, and
    ``CheckpointMismatchError`` where its kind (the encoder's class) differs; shapes are checked after.
    """
    if not parts:
        raise ValueError("parts={} names no role; name at least one, e.g. ['encoder', 'item_table'].")
    assumed = source_parts is None
    recorded = dict(parts) if source_parts is None else dict(source_parts)
    include: list[str] = []
    rename: dict[str, str] = {}
    roles: dict[str, str] = {}
    for role, part in parts.items():
        theirs = recorded.get(role)
        if theirs is None:
            raise ValueError(
                f"warm start from {source!r}: the checkpoint has no {role!r} part; its model recorded {sorted(recorded)}. "
                "Leave the role out of parts, or start from a checkpoint of a model that has it."
            )
        if theirs.kind != part.kind:
            raise CheckpointMismatchError(
                f"warm start from {source!r}: the {role!r} part differs in kind: the checkpoint's is {theirs.kind}, the "
                f"model's is {part.kind}. Build the model with the checkpoint's kind of {role} (its class and options), "
                "or leave the role out of parts.",
                ("kind",),
            )
        saved = {k[len(theirs.prefix):] for k in source_keys if k.startswith(theirs.prefix)}
        wanted = {k[len(part.prefix):] for k in target_keys if k.startswith(part.prefix)}
        where = " (the checkpoint records no parts: looked where the model holds it)" if assumed else ""
        if not saved:
            raise ValueError(
                f"warm start from {source!r}: the checkpoint holds no tensor of the {role!r} part under "
                f"{theirs.prefix!r}{where}; start from a checkpoint of a model with that part, or leave the role out of parts."
            )
        if saved != wanted:
            lacking, extra = sorted(wanted - saved), sorted(saved - wanted)
            raise CheckpointMismatchError(
                f"warm start from {source!r}: the {role!r} part holds other tensors{where}: the checkpoint lacks "
                f"{[part.prefix + k for k in lacking[:6]]}{' ...' if len(lacking) > 6 else ''} and has "
                f"{[theirs.prefix + k for k in extra[:6]]}{' ...' if len(extra) > 6 else ''} that the model lacks. Build "
                f"the model's {role} with the checkpoint's options (e.g. the encoder's num_layers).",
                ("missing",),
            )
        include.append(theirs.prefix + "*")
        rename[theirs.prefix] = part.prefix
        roles[part.prefix] = role
    return include, rename, roles
