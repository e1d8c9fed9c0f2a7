"""A communication cost model: per-step bytes of each collective -> step time and scaling over nodes.

Trainer-free (no Lightning imports). The inputs are what ``CommAccountant`` records per step on one
rank (purpose, operation, group, calls, payload bytes) and the rank layout (``ParallelTopology``);
the model adds link bandwidths and latencies and a compute time per step:

    step time       = compute + sum of collective times   (``overlapped`` purposes: only beyond compute)
    collective time = latency term + max(intra-node bytes / intra bandwidth, node egress bytes / inter bandwidth)

Assumptions, all stated so they can be checked against a measurement:

* Ranks are symmetric (an even plan): every rank moves what the measured rank moves.
* All-to-all: a rank's payload is split evenly over the ``g`` ranks of its group; the share for
  ranks on other nodes leaves through the node's uplink, which all ``ranks_per_node`` ranks of a
  node share, so node egress = ranks_per_node x payload x (g - r) / g (r: group members per node).
  The share for the other ranks of the node goes over the rank's own intra-node link.
* All-reduce is a ring: every ring edge carries 2(n-1)/n of the payload; a group with r ranks on a
  node (consecutive in the ring) has one edge leaving the node, so node egress = (groups per node) x
  2(n-1)/n x payload. Reduce-scatter carries (n-1)/n of its payload (the whole input), all-gather
  n-1 times its payload (the rank's own chunk, as the accounting records it), broadcast the payload.
* Latency: one round trip (2 one-way latencies) per all-to-all call, 2 ceil(log2 n) one-way
  latencies per all-reduce call (tree / recursive doubling for the small, latency-bound case),
  half that for reduce-scatter and all-gather; the link's latency is the inter-node one when the
  group spans nodes.
* Collectives run one after another and do not overlap compute, except purposes listed in
  ``overlapped`` (e.g. DDP's dense-gradient all-reduce, which runs during backward on GPUs): their
  time only counts where it exceeds the compute time.

Traffic of a TorchRec table-wise model scales analytically (``analytic_traffic``), per rank and step,
with b examples per rank, T tables of dim D and R rows, pooling factor p:

* ``sparse_ids`` (KJT all-to-all, 3 calls): b T (p id_bytes + length_bytes);
* ``embeddings`` (pooled all-to-all, forward + backward): b T (row_bytes(D, fwd) + row_bytes(D, bwd)),
  independent of the group size (a rank sends its tables' rows for the group's batch forward and
  its examples' gradients for all tables backward);
* ``dense_grads`` (DDP all-reduce over the world; on gloo in 2D across nodes two, inside the sharding
  group and across the replica group, as the accounting records them): the dense parameter bytes;
* ``replica_sync`` (2D: all-reduce over the replica group every k steps): the rank's shard,
  T R (D + state) 4 / g, divided by k per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_recsys.parallel.comms import wire_bytes_per_value
from lightning_recsys.parallel.topology import LAYOUTS, ParallelTopology

OPS: tuple[str, ...] = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "broadcast")
GROUPS: tuple[str, ...] = ("shard", "replicate", "world")
# The cost model's precision names -> the QComms precision whose wire bytes they cost (parallel/comms/codecs.py).
_QCOMMS_PRECISION: dict[str, str] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3", "int8": "int8"}


# --------------------------------------------------------------------------- hardware
@dataclass(frozen=True, kw_only=True)
class Link:
    """One direction of a link: bytes per second and one-way latency in seconds.

    ``burst_bytes`` is a token-bucket shaper's bucket (tc TBF ``burst``): the first that many bytes
    of each call pass at line rate when the link was idle before it. 0 for a real NIC.
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0 (use math.inf for a free link).")
        if self.latency_s < 0 or self.burst_bytes < 0:
            raise ValueError(f"latency_s={self.latency_s} and burst_bytes={self.burst_bytes} must be >= 0.")

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_us: float = 0.0) -> Link:
        return cls(bandwidth_bytes_per_s=gbit_per_s * 1e9 / 8, latency_s=latency_us * 1e-6)

    @classmethod
    def free(cls) -> Link:
        """A link whose cost is already inside the measured compute time (e.g. loopback)."""
        return cls(bandwidth_bytes_per_s=math.inf, latency_s=0.0)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``ranks_per_node``; ``intra`` is each rank's own link inside the node (NVLink-class),
    ``inter`` the node's uplink, shared by its ranks."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError(f"nodes={self.nodes} and ranks_per_node={self.ranks_per_node} must be >= 1.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


# --------------------------------------------------------------------------- traffic
@dataclass(frozen=True, kw_only=True)
class Collective:
    """Per step, on one rank: ``calls`` calls (fractional when it runs every k steps) moving
    ``payload_bytes`` in total (the bytes this rank hands to the collective), over ``group``."""

    purpose: str
    op: str
    group: str
    calls: float
    payload_bytes: float

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} is not one of {list(OPS)}.")
        if self.group not in GROUPS:
            raise ValueError(f"group={self.group!r} is not one of {list(GROUPS)}.")
        if self.calls < 0 or self.payload_bytes < 0:
            raise ValueError(f"calls={self.calls} and payload_bytes={self.payload_bytes} must be >= 0.")


def collectives_from_accounting(rows: Iterable[Mapping[str, Any]]) -> list[Collective]:
    """``Collective``s from accounting rows (``TrafficKey`` fields + ``Traffic`` fields, e.g. the
    benchmark JSON's ``traffic_per_step_rank0``). Groups named by their ranks are not supported."""
    out = []
    for row in rows:
        if row["group"] not in GROUPS:
            raise ValueError(f"accounting row {dict(row)} is on group {row['group']!r}; the model knows {list(GROUPS)}.")
        out.append(
            Collective(
                purpose=row["purpose"],
                op=row["op"],
                group=row["group"],
                calls=float(row["calls"]),
                payload_bytes=float(row["payload_bytes"]),
            )
        )
    return out


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class GroupGeometry:
    """A process group as the model sees it: ``size`` ranks over ``nodes`` nodes, ``per_node`` of them
    on each of those nodes, and ``groups_per_node`` such groups sharing one node."""

    size: int
    nodes: int
    per_node: int
    groups_per_node: int


def group_geometry(topology: ParallelTopology, group: str) -> GroupGeometry:
    """Geometry of rank 0's ``shard``, ``replicate`` or ``world`` group (ranks are symmetric)."""
    node_size = topology.node_size
    if group == "world":
        ranks = list(range(topology.world_size))
    elif group == "shard":
        ranks = topology.sharding_group_of(0)
    elif group == "replicate":
        ranks = topology.replica_group_of(0)
    else:
        raise ValueError(f"group={group!r} is not one of {list(GROUPS)}.")
    nodes = {topology.node_of(r) for r in ranks}
    per_node = len(ranks) // len(nodes)
    return GroupGeometry(size=len(ranks), nodes=len(nodes), per_node=per_node, groups_per_node=node_size // per_node)


def topology_for(cluster: Cluster, sharding_group_size: int | None, layout: str = "all_to_all_optimized") -> ParallelTopology:
    """The rank layout the strategy would build on ``cluster`` (None: 1D over all ranks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}.")
    return ParallelTopology(
        world_size=cluster.world_size,
        sharding_group_size=sharding_group_size or cluster.world_size,
        layout=layout,  # type: ignore[arg-type]
        ranks_per_node=cluster.ranks_per_node,
    )


# --------------------------------------------------------------------------- time
@dataclass(frozen=True)
class CollectiveCost:
    collective: Collective
    intra_bytes: float  # per rank, over its intra-node link
    inter_bytes: float  # per node, over its uplink
    bandwidth_s: float
    latency_s: float

    @property
    def seconds(self) -> float:
        return self.bandwidth_s + self.latency_s


def collective_cost(c: Collective, geometry: GroupGeometry, cluster: Cluster) -> CollectiveCost:
    """Time of one step's worth of collective ``c`` (all its calls) on ``cluster``."""
    g, m, r = geometry.size, geometry.nodes, geometry.per_node
    if g <= 1 or c.calls == 0:
        return CollectiveCost(c, 0.0, 0.0, 0.0, 0.0)
    payload = c.payload_bytes
    if c.op == "all_to_all":
        intra = payload * (r - 1) / g
        inter = cluster.ranks_per_node * payload * (g - r) / g if m > 1 else 0.0
        hops = 2.0  # one round trip
    else:
        # Bytes on each ring edge: 2(g-1)/g of the payload for all-reduce, (g-1)/g for reduce-scatter (the payload
        # is the whole input), g-1 chunks for all-gather (the payload is this rank's chunk), all of it for broadcast.
        edge = payload * {"all_reduce": 2.0 * (g - 1) / g, "reduce_scatter": (g - 1) / g, "all_gather": g - 1.0, "broadcast": 1.0}[c.op]
        intra = edge if r > 1 else 0.0
        inter = geometry.groups_per_node * edge if m > 1 else 0.0
        steps = math.ceil(math.log2(g))
        hops = {"all_reduce": 2.0 * steps, "reduce_scatter": steps, "all_gather": steps, "broadcast": steps}[c.op]
    link_latency = cluster.inter.latency_s if m > 1 else cluster.intra.latency_s
    bandwidth = max(_seconds(intra, c.calls, cluster.intra), _seconds(inter, c.calls, cluster.inter))
    return CollectiveCost(c, intra, inter, bandwidth, c.calls * hops * link_latency)


def _seconds(nbytes: float, calls: float, link: Link) -> float:
    if nbytes == 0 or math.isinf(link.bandwidth_bytes_per_s):
        return 0.0
    return max(0.0, nbytes - calls * link.burst_bytes) / link.bandwidth_bytes_per_s


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float
    costs: tuple[CollectiveCost, ...]
    overlapped: frozenset[str] = field(default_factory=frozenset)

    @property
    def comm_s(self) -> float:
        """Communication time on the critical path (overlapped purposes only beyond compute)."""
        hidden = sum(k.seconds for k in self.costs if k.collective.purpose in self.overlapped)
        exposed = sum(k.seconds for k in self.costs if k.collective.purpose not in self.overlapped)
        return exposed + max(0.0, hidden - self.compute_s)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def inter_node_bytes(self) -> float:
        """Bytes per step leaving one node."""
        return sum(k.inter_bytes for k in self.costs)

    def seconds_by_purpose(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in self.costs:
            out[k.collective.purpose] = out.get(k.collective.purpose, 0.0) + k.seconds
        return out


def step_time(
    collectives: Sequence[Collective],
    topology: ParallelTopology,
    cluster: Cluster,
    compute_s: float,
    *,
    overlapped: Iterable[str] = (),
) -> StepEstimate:
    """Step time = compute + every collective's time (those in ``overlapped`` only beyond compute)."""
    if compute_s < 0:
        raise ValueError(f"compute_s={compute_s} must be >= 0.")
    if topology.world_size != cluster.world_size or topology.node_size != cluster.ranks_per_node:
        raise ValueError(
            f"topology (world {topology.world_size}, {topology.node_size} ranks per node) does not match the cluster "
            f"({cluster.nodes} nodes x {cluster.ranks_per_node})."
        )
    geometries = {g: group_geometry(topology, g) for g in GROUPS}
    costs = tuple(collective_cost(c, geometries[c.group], cluster) for c in collectives)
    return StepEstimate(compute_s, costs, frozenset(overlapped))


def network_penalty(
    collectives: Sequence[Collective], topology: ParallelTopology, cluster: Cluster, unshaped_step_s: float, **kw: Any
) -> float:
    """Predicted step time on ``cluster`` / the measured unshaped step time, which is taken as the
    compute time (the unshaped links' cost is inside it)."""
    return step_time(collectives, topology, cluster, unshaped_step_s, **kw).step_s / unshaped_step_s


def scaling_factor(step_one_node_s: float, step_n_nodes_s: float, nodes: int) -> float:
    """Throughput on ``nodes`` nodes over one node's, with the per-rank batch fixed (weak scaling)."""
    return nodes * step_one_node_s / step_n_nodes_s


def fit_compute_for_scaling(t_comm_one_node_s: float, t_comm_n_nodes_s: float, nodes: int, target_scaling: float) -> float:
    """The compute time per step at which ``scaling_factor`` on ``nodes`` nodes equals ``target_scaling``.

    Solves nodes (C + t1) / (C + tN) = s for C. Raises when no C >= 0 gives that scaling.
    """
    if not 0 < target_scaling < nodes:
        raise ValueError(f"target_scaling={target_scaling} must be in (0, nodes={nodes}).")
    compute = (target_scaling * t_comm_n_nodes_s - nodes * t_comm_one_node_s) / (nodes - target_scaling)
    if compute < 0:
        raise ValueError(
            f"no compute time >= 0 gives {target_scaling}x on {nodes} nodes: communication alone "
            f"({t_comm_one_node_s:.3g} s on one node, {t_comm_n_nodes_s:.3g} s on {nodes}) already scales better."
        )
    return compute


# --------------------------------------------------------------------------- analytic traffic
def row_bytes(dim: int, precision: str) -> float:
    """Bytes of one pooled embedding row of width ``dim`` on the wire (fp8/int8: one scale block per row)."""
    if precision not in _QCOMMS_PRECISION:
        raise ValueError(f"precision={precision!r} is not one of {list(_QCOMMS_PRECISION)}.")
    return dim * wire_bytes_per_value(_QCOMMS_PRECISION[precision], block_size=dim)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one rank trains per step: the shape that sets the bytes of every collective."""

    batch_per_rank: int
    num_tables: int
    embedding_dim: int
    rows_per_table: int
    pooling_factor: float
    dense_param_bytes: float
    id_bytes: int = 8
    length_bytes: int = 8
    synced_state_per_row: float = 0.0  # optimizer floats per row synced with the weights (row-wise Adagrad: 1)

    def __post_init__(self) -> None:
        for name in ("batch_per_rank", "num_tables", "embedding_dim", "rows_per_table"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.pooling_factor <= 0 or self.dense_param_bytes < 0:
            raise ValueError(f"pooling_factor={self.pooling_factor} must be > 0 and dense_param_bytes >= 0.")


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """How the strategy runs it: sharding group size (None: 1D), layout, comm precisions, sync interval."""

    sharding_group_size: int | None = None
    layout: str = "all_to_all_optimized"
    forward: str = "fp32"
    backward: str = "fp32"
    sync_every_n_steps: int = 1

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {list(LAYOUTS)}.")
        row_bytes(1, self.forward), row_bytes(1, self.backward)  # validates both
        if self.sync_every_n_steps < 1:
            raise ValueError(f"sync_every_n_steps={self.sync_every_n_steps} must be >= 1.")


def analytic_traffic(workload: Workload, parallelism: Parallelism, topology: ParallelTopology) -> list[Collective]:
    """Per-rank, per-step collectives of a table-wise sharded model (see the module docstring)."""
    w, p = workload, parallelism
    b, t, d = w.batch_per_rank, w.num_tables, w.embedding_dim
    out = [
        Collective(purpose="sparse_ids", op="all_to_all", group="shard", calls=3,
                   payload_bytes=b * t * (w.pooling_factor * w.id_bytes + w.length_bytes)),
        Collective(purpose="embeddings", op="all_to_all", group="shard", calls=2,
                   payload_bytes=b * t * (row_bytes(d, p.forward) + row_bytes(d, p.backward))),
        Collective(purpose="dense_grads", op="all_reduce", group="world", calls=1, payload_bytes=w.dense_param_bytes),
    ]  # fmt: skip
    if not topology.is_1d:
        shard = t * w.rows_per_table * (d + w.synced_state_per_row) * 4 / topology.sharding_group_size
        out.append(
            Collective(purpose="replica_sync", op="all_reduce", group="replicate",
                       calls=1 / p.sync_every_n_steps, payload_bytes=shard / p.sync_every_n_steps)
        )  # fmt: skip
    return out


def scale_traffic(
    measured: Sequence[Collective],
    *,
    measured_workload: Workload,
    measured_parallelism: Parallelism,
    measured_topology: ParallelTopology,
    workload: Workload,
    parallelism: Parallelism,
    topology: ParallelTopology,
) -> list[Collective]:
    """Measured per-step collectives rescaled to another workload, parallelism and layout.

    Each measured row of a known purpose is multiplied by analytic(target) / analytic(measured) for
    that purpose, so whatever the formula misses (KJT metadata, bucket padding) scales along; rows of
    other purposes (metrics, other) are kept as measured. ``replica_sync`` appears or disappears with
    the target layout (a 1D target has none).
    """
    source = {c.purpose: c for c in analytic_traffic(measured_workload, measured_parallelism, measured_topology)}
    target = {c.purpose: c for c in analytic_traffic(workload, parallelism, topology)}
    out = []
    for c in measured:
        if c.purpose in target and c.purpose in source:
            s, t = source[c.purpose], target[c.purpose]
            ratio = t.payload_bytes / s.payload_bytes if s.payload_bytes else 0.0
            calls = c.calls * (t.calls / s.calls if s.calls else 1.0)
            out.append(replace(c, calls=calls, payload_bytes=c.payload_bytes * ratio, group=t.group))
        elif c.purpose not in source:
            out.append(c)
    have = {c.purpose for c in out}
    out.extend(t for purpose, t in target.items() if purpose not in have)  # e.g. replica_sync for a 2D target of a 1D profile
    return out
