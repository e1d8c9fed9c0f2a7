"""How 2D training keeps the replicas of its sharded tables in step: ``ReplicaSyncConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ROWS = ("touched", "all")
PRECISIONS = ("fp32", "bf16", "fp8")
EXCHANGES = ("all_reduce", "all_gather")
AVERAGES = ("auto", "all_replicas", "touching_replicas")


@dataclass(kw_only=True, frozen=True)
class ReplicaSyncConfig:
    """The replica sync of 2D training: which rows, how often, in what precision.

    Args:
        rows: ``"touched"`` (default) averages only the union, over the replica group, of the rows
            looked up since the last sync; untouched rows are equal on every replica already, so
            with ``average="all_replicas"`` the result is the same as ``"all"``, which averages
            every row of every local shard over all replicas.
        every_n_steps: sync every n training steps (default 1). Evaluation, checkpoint saves and
            the end of training sync too, if a step ran since the last sync.
        overlap: launch the sync's all-reduce in the background at the end of its step and apply
            it at the end of the interval's last step, just before the next sync, keeping the
            updates made meanwhile (``row = average(sent) + (row - sent)``): the tables see each
            average ``every_n_steps`` steps late, and the all-reduce has the whole interval to
            complete (it starts in a share per step, so no step's dense all-reduce queues behind
            the whole sync on a shared link). Costs the synced rows' values twice in memory until applied (with
            ``rows="all"``, twice the shard). Forced syncs apply a sync in flight first. Default
            False (blocking).
        precision: what the sync sends for the weights: ``"fp32"`` (default) the rows' values;
            ``"bf16"`` each touched row's change since the last sync in bf16, every replica then
            setting ``row = base + average(change)`` (replicas stay bit-identical; rounding hits only
            the change); ``"fp8"`` the same change in fp8 (e4m3) with one fp32 scale per row, which
            cannot be summed on the wire and so needs ``exchange="all_gather"``. Both need
            ``rows="touched"``; optimizer state goes as fp32 changes.
        exchange: how the replicas swap the touched rows. ``"all_reduce"`` (default): agree on the
            union of the rows touched (a small all-gather of row ids or bitmaps, blocking), then
            all-reduce those rows: bytes per replica about twice the union's rows. ``"all_gather"``:
            every replica all-gathers the rows it touched with their changes since the last sync
            (ids included) and each adds them up in replica order, with no union agreement: bytes
            per replica about (replicas - 1) times its own touched rows. It wins where replicas
            touch mostly different rows (long-tail ids, few replicas) and sends changes, not values
            (it needs ``rows="touched"``; with ``precision="fp32"`` the changes are fp32).
        optimizer_state: also average the fused optimizer state (row-wise Adagrad's accumulators,
            Adam's moments), default True.
        average: what a row's summed change is divided by. ``"all_replicas"``: every replica, as
            TorchRec's ``DMPCollection.sync`` does; with SGD this is exactly the 1D update.
            ``"touching_replicas"``: only the replicas that looked the row up since the last sync
            (needs ``rows="touched"``). Adaptive optimizers (row-wise Adagrad, Adagrad, Adam) step a
            row about as far whatever its share of the batch, so averaging over all replicas moves a
            row that one of R replicas touched 1/R as far as 1D training would; dividing by the
            touching replicas keeps that step. ``"auto"`` (default): ``"touching_replicas"`` with an
            adaptive embedding optimizer and ``rows="touched"``, else ``"all_replicas"``.
    """

    rows: Literal["touched", "all"] = "touched"
    every_n_steps: int = 1
    overlap: bool = False
    precision: Literal["fp32", "bf16", "fp8"] = "fp32"
    optimizer_state: bool = True
    exchange: Literal["all_reduce", "all_gather"] = "all_reduce"
    average: Literal["auto", "all_replicas", "touching_replicas"] = "auto"

    def __post_init__(self) -> None:
        if self.rows not in ROWS:
            raise ValueError(f"ReplicaSyncConfig.rows={self.rows!r} must be one of {list(ROWS)}.")
        steps = self.every_n_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ReplicaSyncConfig.every_n_steps={steps!r} must be an integer >= 1.")
        for name in ("overlap", "optimizer_state"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ReplicaSyncConfig.{name}={getattr(self, name)!r} must be a bool.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ReplicaSyncConfig.precision={self.precision!r} must be one of {list(PRECISIONS)}.")
        if self.precision != "fp32" and self.rows != "touched":
            raise ValueError(
                f"ReplicaSyncConfig.precision={self.precision!r} needs rows='touched' (got rows={self.rows!r}): the deltas are "
                "taken against each touched row's value at the last sync, kept only for touched rows."
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(f"ReplicaSyncConfig.exchange={self.exchange!r} must be one of {list(EXCHANGES)}.")
        if self.exchange == "all_gather" and self.rows != "touched":
            raise ValueError(
                f"ReplicaSyncConfig.exchange='all_gather' needs rows='touched' (got rows={self.rows!r}): each replica sends "
                "the rows it touched; with rows='all' use exchange='all_reduce'."
            )
        if self.precision == "fp8" and self.exchange != "all_gather":
            raise ValueError(
                f"ReplicaSyncConfig.precision='fp8' needs exchange='all_gather' (got exchange={self.exchange!r}): "
                "scaled fp8 changes cannot be summed by an all-reduce on the wire."
            )
        if self.average not in AVERAGES:
            raise ValueError(f"ReplicaSyncConfig.average={self.average!r} must be one of {list(AVERAGES)}.")
        if self.average == "touching_replicas" and self.rows != "touched":
            raise ValueError(
                f"ReplicaSyncConfig.average='touching_replicas' needs rows='touched' (got rows={self.rows!r}): only "
                "touched-row tracking knows which replicas looked a row up; use average='all_replicas' with rows='all'."
            )

    @property
    def sends_deltas(self) -> bool:
        """Whether the sync sends each touched row's change since the last sync (captured bases needed)."""
        return self.precision != "fp32" or self.exchange == "all_gather"

    def averages_over_touching_replicas(self, adaptive_optimizer: bool) -> bool:
        """Whether a row's change is divided by the replicas that touched it (``average`` resolved).

        ``adaptive_optimizer``: the tables' optimizer normalizes each row's step (anything but SGD).
        """
        if self.average == "auto":
            return adaptive_optimizer and self.rows == "touched"
        return self.average == "touching_replicas"

    def describe(self) -> str:
        """A short label, e.g. ``touched rows, every 4, overlapped, bf16 deltas``."""
        parts = [f"{self.rows} rows", f"every {self.every_n_steps}"]
        if self.overlap:
            parts.append("overlapped")
        if self.precision != "fp32":
            parts.append(f"{self.precision} deltas")
        if self.exchange != "all_reduce":
            parts.append(self.exchange.replace("_", "-"))
        if self.average != "auto":
            parts.append(f"averaged over {self.average.replace('_', ' ')}")
        return ", ".join(parts)
