"""The all-gather replica sync's CPU cost on its own: launch, send and apply of one ``GatheredSync``.

Two processes on this machine (gloo over loopback, one thread each) hold the emulated cluster's
rank-0 tables (10^6, 5·10^5, 2·10^5 and 10^5 rows, twice each, dim 16, fp32). Per sync each
replica changes a heavy-tailed set of rows (their bases captured, as the row tracker does), then
launches the exchange, sends it in pieces (``progress()``, as ``ReplicaSynchronizer.step_ended``
does with ``overlap=True``), touches a new interval's rows, and applies it. Prints rank 0's median
milliseconds per sync for each phase, and the rows per replica and in the union::

    python benchmarks/sync_exchange.py
    python benchmarks/sync_exchange.py --precision bf16 --touched 8000 --syncs 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from lightning_recsys.parallel.sync.sync_gather import GatheredSync
from lightning_recsys.parallel.sync.touched_rows import Table
from lightning_recsys.testing.processes import run_ranks

ROWS = (10**6, 5 * 10**5, 2 * 10**5, 10**5) * 2
DIM = 16


def _heavy_tailed_rows(rows: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct rows from ``draws`` log-uniform draws (a few hot rows, a long tail), in no order (the all-gather
    sync's row tracker keeps them in lookup order)."""
    distinct = torch.unique((rows ** torch.rand(draws, generator=generator)).long().clamp_(max=rows - 1))
    return distinct[torch.randperm(distinct.numel(), generator=generator)]


def _capture(table: Table, rows: torch.Tensor) -> None:
    table.base_rows, table.base_values = [rows], [[t.index_select(0, rows) for t in table.tensors]]


def _run(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(0)  # every replica starts equal, as right after a sync
    tables, offset = [], 0
    for rows in ROWS:
        tables.append(Table(offset, rows, [torch.randn(rows, DIM, generator=generator)]))
        offset += rows
    timings: list[tuple[float, float, float]] = []
    for sync_index in range(args.syncs + 2):  # the first two warm up
        g = torch.Generator().manual_seed(1000 * sync_index + rank)
        touched = []
        for table in tables:
            rows = _heavy_tailed_rows(table.rows, args.touched, g)
            _capture(table, rows)
            table.tensors[0].index_add_(0, rows, torch.randn(rows.numel(), DIM, generator=g) * 0.01)
            touched.append(table.bases(sort=False)[0])  # as ReplicaSynchronizer passes them
        dist.barrier()
        start = time.perf_counter()
        sync = GatheredSync(tables, touched, dist.group.WORLD, world, weight_precision=args.precision, overlap=True,
                            defer_exchange=args.pieces > 0, exchange_pieces=max(1, args.pieces))
        launched = time.perf_counter()
        for _ in range(args.pieces):
            sync.progress()
        sent = time.perf_counter()
        for table in tables:  # the next interval's first touches, some of them rows of this sync
            _capture(table, _heavy_tailed_rows(table.rows, args.touched // 2, g))
        before_apply = time.perf_counter()
        sync.apply()
        applied = time.perf_counter()
        for table in tables:
            table.clear()
        if sync_index >= 2:
            timings.append((launched - start, sent - launched, applied - before_apply))
        own_rows, union_rows = sum(int(r.numel()) for r in touched), sync.rows_synced
    if rank == 0:
        launch, send, apply = (1e3 * statistics.median(t[i] for t in timings) for i in range(3))
        print(f"{args.precision}, {args.pieces} pieces: launch {launch:.1f} ms, send {send:.1f} ms, apply {apply:.1f} ms per sync "
              f"(median of {args.syncs}); rows per replica {own_rows:,}, union {union_rows:,}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp8"), default="fp8")
    parser.add_argument("--touched", type=int, default=16000, help="heavy-tailed draws per table and sync (default 16000)")
    parser.add_argument("--pieces", type=int, default=3, help="progress() calls between launch and apply; 0: send at launch (default 3)")
    parser.add_argument("--syncs", type=int, default=6, help="timed syncs (default 6)")
    parser.add_argument("--port", type=int, default=29555)
    args = parser.parse_args()
    run_ranks(_run, 2, args, timeout=3600)  # forks of a server that imported torch once (spawn where CUDA is)


if __name__ == "__main__":
    main()
