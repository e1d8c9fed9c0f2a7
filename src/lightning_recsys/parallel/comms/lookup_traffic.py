"""The sequence all-to-all's bytes split by feature: what each rank's own lookups send and receive, from its ids.

TorchRec's ``ShardedEmbeddingCollection`` sends every feature of a table through one all-to-all
(``SequenceEmbeddingsAllToAll`` in ``torchrec/distributed/sharding/sequence_sharding.py``), so the
payload the accountant sees is one tensor per direction. Its feature mix is known on the rank that
asks for the rows: for each id of each feature, the shards of its table that hold the row (the plan's
``sharding_spec``: row range, column width, owner) each return ``width`` values in the forward, and get
``width`` gradient values back in the backward, at the QComms precision of that direction.

So per training step this rank's lookups **receive** ``embeddings`` (forward) and **send**
``gradients`` (backward) of ``ids x width x wire bytes per value`` per feature. Summed over the ranks
this is exactly the all-to-all's payload: what one rank receives in the forward, its owners sent.

Index dedup (``QCommsConfig(index_dedup=True)``, TorchRec's ``_dedup_indices``) sends each distinct id
of a table once per rank, whichever features hold it. Such an id is filed under the **first** of the
table's features that holds it (the table's ``feature_names`` order): for ``SequencePretrainer``,
``item_id`` (history) first, then ``next_item_id`` (targets: only those not in the history) and
``negative_item_id`` (negatives: only those in neither).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.parallel.topology import ParallelTopology

FORWARD, BACKWARD = "embeddings", "gradients"  # the directions of the sequence all-to-all, as the summary names them


@dataclass(frozen=True)
class ShardPiece:
    """One shard of a table: rows ``[row_start, row_end)``, ``cols`` columns from ``col_start``, on global rank ``owner``."""

    row_start: int
    row_end: int
    cols: int
    owner: int
    col_start: int = 0


@dataclass(frozen=True)
class TableRoute:
    """A sequence table's features (in attribution order) and the shards its rows travel to."""

    table: str
    features: tuple[str, ...]
    pieces: tuple[ShardPiece, ...]


@dataclass(frozen=True)
class LookupBytes:
    """Bytes of one (direction, feature) on this rank in one step: all of it, and the part to or from other nodes."""

    ids: int
    payload_bytes: int
    inter_node_bytes: int


def feature_ids(features: KeyedJaggedTensor, route: TableRoute, *, index_dedup: bool) -> dict[str, torch.Tensor]:
    """The ids of each of ``route``'s features that go through the all-to-all (module docstring: dedup's filing)."""
    out: dict[str, torch.Tensor] = {}
    keys = set(features.keys())
    seen = torch.empty(0, dtype=torch.int64)
    for name in route.features:
        ids = features[name].values().to(torch.int64).cpu() if name in keys else torch.empty(0, dtype=torch.int64)
        if index_dedup:
            ids = torch.unique(ids)
            ids = ids[~torch.isin(ids, seen)]
            seen = torch.cat([seen, ids])
        out[name] = ids
    return out


def lookup_counts(features: KeyedJaggedTensor, route: TableRoute, *, index_dedup: bool) -> torch.Tensor:
    """``[features, pieces]`` int64 on the ids' device: the ids of each feature that go to each shard (as ``feature_ids``).

    No host synchronisation (no ``.item()``, no data-dependent shapes), so counting a CUDA batch does not stall the
    step: the ids are sorted with their feature index, and under dedup each id counts once, for its first feature.
    """
    keys = set(features.keys())
    device = features.values().device
    ids, owners = [], []
    for index, name in enumerate(route.features):
        if name in keys:
            values = features[name].values().to(torch.int64)
            ids.append(values)
            owners.append(torch.full_like(values, index))
    counts = torch.zeros(len(route.features), len(route.pieces), dtype=torch.int64, device=device)
    if not ids:
        return counts
    flat, feature = torch.cat(ids), torch.cat(owners)
    keep = torch.ones_like(flat, dtype=torch.bool)
    if index_dedup:  # sort by (id, feature): an id's first entry is its first feature's
        order = torch.argsort(flat * len(route.features) + feature)
        flat, feature = flat[order], feature[order]
        keep[1:] = flat[1:] != flat[:-1]
    for column, piece in enumerate(route.pieces):
        inside = keep & (flat >= piece.row_start) & (flat < piece.row_end)
        counts[:, column].index_add_(0, feature, inside.to(torch.int64))
    return counts


def counted_bytes(
    counts: torch.Tensor, route: TableRoute, *, wire_bytes: tuple[float, float], topology: ParallelTopology, rank: int
) -> dict[tuple[str, str], LookupBytes]:
    """``(direction, feature) -> LookupBytes`` from ``lookup_counts`` (``wire_bytes``: bytes per value, forward and backward)."""
    table = counts.cpu().tolist()
    my_node = topology.node_of(rank)
    out: dict[tuple[str, str], LookupBytes] = {}
    for name, row in zip(route.features, table):
        values = sum(n * p.cols for n, p in zip(row, route.pieces))
        remote = sum(n * p.cols for n, p in zip(row, route.pieces) if topology.node_of(p.owner) != my_node)
        ids = sum(n for n, p in zip(row, route.pieces) if p.col_start == 0)  # each id once, whatever its column slices
        for direction, per_value in zip((FORWARD, BACKWARD), wire_bytes):
            out[(direction, name)] = LookupBytes(
                ids=ids, payload_bytes=round(values * per_value), inter_node_bytes=round(remote * per_value)
            )
    return out


def lookup_bytes(
    features: KeyedJaggedTensor,
    routes: Iterable[TableRoute],
    *,
    index_dedup: bool,
    wire_bytes: tuple[float, float],
    topology: ParallelTopology,
    rank: int,
) -> dict[tuple[str, str], LookupBytes]:
    """``(direction, feature) -> LookupBytes`` of this rank's lookup of ``features`` (one step's forward and backward).

    ``wire_bytes``: bytes per value on the wire (forward, backward), scales included (``EffectiveQComms.wire_bytes``).
    """
    out: dict[tuple[str, str], LookupBytes] = {}
    for route in routes:
        counts = lookup_counts(features, route, index_dedup=index_dedup)
        out.update(counted_bytes(counts, route, wire_bytes=wire_bytes, topology=topology, rank=rank))
    return out


def table_routes(
    table_features: Mapping[str, Iterable[str]], module_plan: Mapping[str, object], group_ranks: list[int]
) -> list[TableRoute]:
    """The routes of a sharded module's tables from its plan (``EmbeddingModuleShardingPlan``: table -> ``ParameterSharding``).

    ``group_ranks``: this rank's sharding group, global ranks; the plan's placements are group-local.
    Data-parallel tables (no ``sharding_spec``) send nothing through the all-to-all and get no route.
    """
    routes = []
    for table, features in table_features.items():
        sharding = module_plan.get(table)
        spec = getattr(sharding, "sharding_spec", None)
        shards = getattr(spec, "shards", None)
        if not shards:
            continue
        pieces = tuple(
            ShardPiece(
                row_start=int(s.shard_offsets[0]), row_end=int(s.shard_offsets[0] + s.shard_sizes[0]), cols=int(s.shard_sizes[1]),
                owner=group_ranks[s.placement.rank()], col_start=int(s.shard_offsets[1]),
            )
            for s in shards
        )
        routes.append(TableRoute(table=table, features=tuple(features), pieces=pieces))
    return routes
