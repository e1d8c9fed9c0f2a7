"""Reshaped tables: rebuild a model's EmbeddingBagCollections with (2 rows, dim / 2) tables, in place.

This is model surgery before sharding, so it lives with the other step that turns the user's
model into the one TorchRec shards (``shard_model``); the planner only advises which tables to
reshape (``lightning_recsys.planner.reshape.suggest_reshape``). Any advice with the fields
``table``, ``rows``, ``dim``, ``new_rows`` and ``new_dim`` will do.

What changes for the user (the reshape is opt-in and changes the model, so old checkpoints of the
reshaped tables do not load into it):

* **Ids.** ``id_mapping="interleave"`` (default) sends id ``i`` of a reshaped table to row
  ``2 i + h(i)``, where ``h(i)`` is bit 16 of ``(i * 2654435761) mod 2**32`` (a fixed
  multiplicative hash): every id keeps a row of its own, ids stay in range exactly when they were
  (an id ``>= rows`` maps to ``>= 2 rows``), but only half of the rows are ever used. To use them
  all, hash the raw feature values into ``2 rows`` buckets in the data pipeline (e.g. double a
  Criteo DataModule's ``table_sizes``) and pass ``id_mapping="identity"``.
* **Outputs.** With ``restore_dim=True`` (default) each reshaped table gets a bias-free
  ``Linear(dim / 2, dim)`` applied after the exchange, on the receiving rank, so every feature
  still yields a ``dim``-wide vector and models such as DLRM (which need equal widths) work
  unchanged. It starts as two stacked identities (the half-width vector, duplicated) and is
  trained with the dense parameters. ``restore_dim=False`` leaves the outputs ``dim / 2`` wide.
* **Parameters.** ``2 rows x dim / 2`` table weights, the same as before, plus ``dim**2 / 2``
  dense projection weights per table.

No Lightning imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    KeyedTensor,
)

IdMapping = Literal["interleave", "identity"]
ID_MAPPINGS: tuple[str, ...] = ("interleave", "identity")
_HASH_MULTIPLIER = 2654435761  # Knuth's multiplicative hash constant


class TableReshape(Protocol):
    """Reshape ``table`` from ``(rows, dim)`` to ``(new_rows, new_dim)``, e.g. a planner ``ReshapeAdvice``."""

    @property
    def table(self) -> str: ...

    @property
    def rows(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def new_rows(self) -> int: ...

    @property
    def new_dim(self) -> int: ...


def remap_ids(ids: torch.Tensor, mapping: IdMapping) -> torch.Tensor:
    """Row of each id in a reshaped (doubled) table; see the module docstring."""
    if mapping == "identity":
        return ids
    bit = torch.bitwise_and(torch.bitwise_right_shift(torch.bitwise_and(ids * _HASH_MULTIPLIER, 0xFFFFFFFF), 16), 1)
    return ids * 2 + bit


class ReshapedEmbeddingBagCollection(nn.Module):
    """An EmbeddingBagCollection with some tables reshaped, presenting the original feature widths.

    ``ebc`` (the reshaped collection) is what TorchRec shards; the id remap and the projections
    are ordinary (data-parallel) computation around it.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        original: Sequence[EmbeddingBagConfig],
        reshaped: Sequence[str],
        *,
        id_mapping: IdMapping = "interleave",
        restore_dim: bool = True,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if id_mapping not in ID_MAPPINGS:
            raise ValueError(f"id_mapping={id_mapping!r} is not one of {list(ID_MAPPINGS)}.")
        self.ebc = ebc
        self._original = list(original)
        self._reshaped = set(reshaped)
        self._id_mapping: IdMapping = id_mapping
        self._restore_dim = restore_dim
        self._feature_table = {f: t.name for t in self._original for f in t.feature_names}
        self._remapped_features = {f for f, t in self._feature_table.items() if t in self._reshaped}
        # What a checkpoint records (``reshape_record``) so that an unsharded model can be rebuilt to load it.
        self.reshape_record = [
            {
                "table": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim,
                "new_rows": n.num_embeddings, "new_dim": n.embedding_dim,
                "id_mapping": id_mapping, "restore_dim": restore_dim,
            }
            for t, n in zip(self._original, ebc.embedding_bag_configs())
            if t.name in self._reshaped
        ]
        self.projections = nn.ModuleDict()
        if restore_dim:
            for table in self._original:
                if table.name in self._reshaped:
                    half = table.embedding_dim // 2
                    proj = nn.Linear(half, table.embedding_dim, bias=False, device=device)
                    with torch.no_grad():  # duplicate the half-width vector: [I; I]
                        proj.weight.copy_(torch.cat([torch.eye(half, device=device), torch.eye(half, device=device)]))
                    self.projections[table.name] = proj

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The configs as the rest of the model sees them (original widths when ``restore_dim``)."""
        if self._restore_dim:
            return list(self._original)
        return list(self.ebc.embedding_bag_configs())

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        out = self.ebc(self._remap(features))
        if not self._restore_dim:
            return out
        keys = out.keys()
        chunks = out.values().split(out.length_per_key(), dim=1)
        values, lengths = [], []
        for key, chunk in zip(keys, chunks):
            table = self._feature_table[key]
            if table in self.projections:
                chunk = self.projections[table](chunk)
            values.append(chunk)
            lengths.append(chunk.shape[1])
        return KeyedTensor(keys=keys, length_per_key=lengths, values=torch.cat(values, dim=1))

    def _remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if self._id_mapping == "identity" or not self._remapped_features:
            return features
        keys = features.keys()
        lengths = features.length_per_key()
        pieces = features.values().split(lengths)
        values = torch.cat([remap_ids(p, self._id_mapping) if k in self._remapped_features else p for k, p in zip(keys, pieces)])
        return KeyedJaggedTensor(
            keys=keys,
            values=values,
            lengths=features.lengths(),
            weights=features.weights_or_none(),
            stride=features.stride(),
        )


def apply_reshape(
    module: nn.Module,
    advice: Sequence[TableReshape],
    *,
    id_mapping: IdMapping = "interleave",
    restore_dim: bool = True,
) -> list[str]:
    """Rebuild every EmbeddingBagCollection of ``module`` that holds an advised table, in place.

    Each such collection is replaced by a ``ReshapedEmbeddingBagCollection`` whose inner collection
    has the advised shapes, on the old collection's device (``meta`` stays ``meta``; otherwise the
    reshaped tables are freshly initialized, the others keep their values). Call it before
    sharding. Returns the names of the replaced submodules.
    """
    if id_mapping not in ID_MAPPINGS:
        raise ValueError(f"apply_reshape(id_mapping={id_mapping!r}) is not one of {list(ID_MAPPINGS)}.")
    by_table = {a.table: a for a in advice}
    found: set[str] = set()
    replaced: list[str] = []
    for fqn, sub in list(module.named_modules()):
        if not isinstance(sub, EmbeddingBagCollection) or _inside_reshaped(module, fqn):
            continue
        configs = list(sub.embedding_bag_configs())
        targets = [c.name for c in configs if c.name in by_table]
        if not targets:
            continue
        for config in configs:
            if config.name in by_table:
                a = by_table[config.name]
                if (config.num_embeddings, config.embedding_dim) != (a.rows, a.dim):
                    raise ValueError(
                        f"reshape advice for {config.name!r} expects {a.rows} x {a.dim}, but the table is "
                        f"{config.num_embeddings} x {config.embedding_dim}; make the advice for this model."
                    )
        new_configs = [
            dataclasses.replace(c, num_embeddings=by_table[c.name].new_rows, embedding_dim=by_table[c.name].new_dim)
            if c.name in by_table
            else c
            for c in configs
        ]
        device = _device_of(sub)
        new_ebc = EmbeddingBagCollection(tables=new_configs, is_weighted=sub.is_weighted(), device=device)
        if device.type != "meta":
            keep = {k: v for k, v in sub.state_dict().items() if not any(f".{t}." in f".{k}" for t in targets)}
            new_ebc.load_state_dict(keep, strict=False)
        dense_device = device if device.type != "meta" else _dense_device(module)
        wrapper = ReshapedEmbeddingBagCollection(
            new_ebc, configs, targets, id_mapping=id_mapping, restore_dim=restore_dim, device=dense_device
        )
        _set_submodule(module, fqn, wrapper)
        found.update(targets)
        replaced.append(fqn)
    missing = sorted(set(by_table) - found)
    if missing:
        raise ValueError(f"reshape advice names tables that no EmbeddingBagCollection of the model has: {missing}.")
    return replaced


RESHAPE_CHECKPOINT_KEY = "lightning_recsys_reshaped_tables"  # in a checkpoint's host state


@dataclasses.dataclass(frozen=True)
class RecordedReshape:
    """One reshaped table as a checkpoint records it (see ``reshape_record``)."""

    table: str
    rows: int
    dim: int
    new_rows: int
    new_dim: int
    id_mapping: IdMapping = "interleave"
    restore_dim: bool = True


def reshape_record(module: nn.Module) -> list[dict[str, object]]:
    """The reshaped tables of ``module`` (sharded or not) as plain dicts, for a checkpoint; [] if none."""
    return [dict(r) for sub in module.modules() if isinstance(sub, ReshapedEmbeddingBagCollection) for r in sub.reshape_record]


def apply_recorded_reshape(module: nn.Module, record: Sequence[dict[str, object]] | None) -> list[str]:
    """Reshape an unsharded ``module`` as a checkpoint's ``record`` says, so that the checkpoint loads into it.

    Does nothing (returns []) without a record, or where the recorded tables are not plain
    ``EmbeddingBagCollection`` tables of their original shapes (already reshaped, or sharded: the
    checkpoint's own mismatch check then speaks). Returns the names of the replaced submodules.
    """
    if not record:
        return []
    recorded = [RecordedReshape(**r) for r in record]  # type: ignore[arg-type]
    shapes = {
        c.name: (c.num_embeddings, c.embedding_dim)
        for fqn, sub in module.named_modules()
        if isinstance(sub, EmbeddingBagCollection) and not _inside_reshaped(module, fqn)
        for c in sub.embedding_bag_configs()
    }
    if any(shapes.get(r.table) != (r.rows, r.dim) for r in recorded):
        return []
    replaced: list[str] = []
    for options in sorted({(r.id_mapping, r.restore_dim) for r in recorded}):
        advice = [r for r in recorded if (r.id_mapping, r.restore_dim) == options]
        replaced += apply_reshape(module, advice, id_mapping=options[0], restore_dim=options[1])
    return replaced


def _inside_reshaped(root: nn.Module, fqn: str) -> bool:
    parts = fqn.split(".")
    node = root
    for part in parts[:-1]:
        node = getattr(node, part)
        if isinstance(node, ReshapedEmbeddingBagCollection):
            return True
    return False


def _device_of(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _dense_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")


def _set_submodule(root: nn.Module, fqn: str, new: nn.Module) -> None:
    if not fqn:
        raise ValueError("apply_reshape() cannot replace the root module; pass the model that contains the collection.")
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
