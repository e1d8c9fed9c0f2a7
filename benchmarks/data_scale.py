"""The data pipeline of ``SequenceParquetDataModule`` at scale: per-rank memory, start, throughput and bytes read.

Generates per-user parquet directly with pyarrow (``PreparedWriter``, one row group at a time, so
generation memory does not grow with ``--events``): Zipf-distributed items over ``--items`` rows, and
user lengths either Beauty-like (``beauty``: 5 + geometric, mean about 9, as BERT4Rec's Amazon Beauty)
or ``long`` (200 events per user). Then, for each world size, starts that many plain processes at
once (ranks of one data set, no Trainer: this measures the data path only) and each reports:

- ``peak_rss_mib``: peak RSS of the process minus its RSS after the imports (an empty process with
  the same libraries), from ``/proc/self/status`` (``VmHWM`` reset after the imports);
- ``first_batch_s``: from constructing the DataModule (it reads only metadata.json) to the first
  training batch;
- ``events_per_s``: events read and batched per second over the measured pass (one epoch, or
  ``--seconds``; with ``--fill``, epoch after epoch until ``--seconds``, so that small and large data
  sets run as long), counted from the DataModule's construction, in the rank's process
  (``num_workers=0``: the one worker is the process itself);
- ``bytes_read`` (of the first epoch) against ``total / world`` and the largest row group.

    python benchmarks/data_scale.py --events 10000000 --lengths beauty long --worlds 2 4

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

EVENTS_PER_GROUP = 1 << 18
GROUPS_PER_FILE = 16


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _lengths(rng, kind: str, count: int):
    import numpy as np

    if kind == "long":
        return np.full(count, 200, dtype=np.int64)
    return 5 + rng.geometric(1 / 4.9, size=count).astype(np.int64) - 1  # mean about 8.9, as Beauty's


def generate(directory: Path, events: int, kind: str, num_items: int, seed: int) -> dict:
    import numpy as np

    from lightning_recsys.data.parquet.writing import PreparedWriter

    rng = np.random.default_rng(seed)
    writer = PreparedWriter(directory, num_items, groups_per_file=GROUPS_PER_FILE)
    mean = 200 if kind == "long" else 8.9
    written, user = 0, 0
    start = time.perf_counter()
    while written < events:
        lengths = _lengths(rng, kind, max(1, int(min(EVENTS_PER_GROUP, events - written) / mean)))
        total = int(lengths.sum())
        items = (rng.zipf(1.2, size=total) - 1) % num_items
        writer.write_group(np.arange(user, user + len(lengths), dtype=np.int64), lengths, items)
        written, user = written + total, user + len(lengths)
    meta = writer.close()
    size = sum((directory / f.path).stat().st_size for f in meta.files)
    return {"events": meta.num_events, "users": meta.num_users, "bytes": size, "seconds": time.perf_counter() - start,
            "files": len(meta.files), "row_groups": sum(len(f.row_groups) for f in meta.files)}


def run_rank(directory: str, rank: int, world_size: int, seconds: float, batch: int, max_length: int, fill: bool = False) -> dict:
    """One rank's pass over its training users (``fill``: epoch after epoch until ``seconds``); the numbers described
    in the module docstring. ``bytes_read`` is the first epoch's (or the partial pass's)."""
    import torch  # noqa: F401 - the libraries a rank has anyway, before the baseline

    from lightning_recsys.data.parquet.module import SequenceParquetDataModule
    from lightning_recsys.data.parquet.streams import EpochLoader

    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = time.perf_counter()
    module = SequenceParquetDataModule(directory, max_length=max_length, global_batch_size=batch * world_size, num_negatives=128)
    stream = module.stream("train", rank, world_size)
    loader = EpochLoader(stream, batch_size=None)
    first_batch = None
    batches = examples = epochs = 0
    first_epoch_bytes = None
    while True:
        for item in loader:
            if first_batch is None:
                first_batch = time.perf_counter() - start
            batches += 1
            examples += item.batch_size
            if time.perf_counter() - start > seconds:
                break
        else:
            epochs += 1
        first_epoch_bytes = first_epoch_bytes if first_epoch_bytes is not None else module.bytes_read
        if not fill or time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start  # from the DataModule's construction: the start is in the rate
    events = module.counter.events
    return {
        "rank": rank, "world_size": world_size, "peak_rss_mib": (_status("VmHWM") - baseline) / 2**20,
        "baseline_rss_mib": baseline / 2**20, "first_batch_s": first_batch, "events_per_s": events / elapsed if elapsed else 0.0,
        "events": events, "batches": batches, "examples": examples, "batches_per_epoch": len(stream), "epochs": epochs,
        "bytes_read": first_epoch_bytes,
    }


def _described(directory: Path) -> dict:
    """``generate``'s summary of a directory it wrote earlier (``--reuse``), from its metadata and file sizes."""
    from lightning_recsys.data.parquet.reader import open_prepared

    meta = open_prepared(directory)
    size = sum((directory / f.path).stat().st_size for f in meta.files)
    return {"events": meta.num_events, "users": meta.num_users, "bytes": size, "seconds": 0.0,
            "files": len(meta.files), "row_groups": sum(len(f.row_groups) for f in meta.files)}


def _largest_group(directory: Path) -> int:
    import pyarrow.parquet as pq

    from lightning_recsys.data.parquet.reader import open_prepared

    largest = 0
    for info in open_prepared(directory).files:
        meta = pq.ParquetFile(directory / info.path).metadata
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            largest = max(largest, sum(group.column(c).total_compressed_size for c in range(group.num_columns)))
    return largest


def measure(directory: Path, world_size: int, args: argparse.Namespace) -> list[dict]:
    """``world_size`` rank processes at once, as the ranks of one job would run."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(rank), "--world", str(world_size), "--dir", str(directory),
             "--seconds", str(args.seconds), "--batch", str(args.batch), "--max-length", str(args.max_length)]
            + (["--fill"] if args.fill else []),
            stdout=subprocess.PIPE, text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"a rank process failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=float, nargs="+", default=[1e7])
    parser.add_argument("--lengths", nargs="+", choices=["beauty", "long"], default=["beauty", "long"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=600.0, help="measure at most this long per rank")
    parser.add_argument("--batch", type=int, default=128, help="local batch size (examples per rank)")
    parser.add_argument("--max-length", type=int, default=50)
    parser.add_argument("--fill", action="store_true", help="run epoch after epoch until --seconds (compares sizes over the same time)")
    parser.add_argument("--root", default="/tmp/lightning_recsys_data_scale")
    parser.add_argument("--keep", action="store_true", help="keep the generated directories")
    parser.add_argument("--reuse", action="store_true", help="measure a directory an earlier --keep run left (same --items) instead of generating it again; it is kept")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        print(json.dumps(run_rank(args.dir, args.rank, args.world, args.seconds, args.batch, args.max_length, args.fill)))
        return
    rows = []
    for events in args.events:
        for kind in args.lengths:
            directory = Path(args.root) / f"{kind}-{int(events)}"
            reused = args.reuse and (directory / "metadata.json").is_file()
            if reused:
                generated = _described(directory)
            else:
                if directory.exists():
                    shutil.rmtree(directory)
                generated = generate(directory, int(events), kind, args.items, seed=0)
            largest = _largest_group(directory)
            how = f"in {generated['seconds']:.1f} s" if generated["seconds"] else f"(reused {directory})"
            print(f"generated {kind} {generated['events']:,} events, {generated['users']:,} users, {generated['bytes'] / 2**20:.1f} MiB, "
                  f"{generated['row_groups']} row groups {how}", flush=True)
            for world_size in args.worlds:
                for result in measure(directory, world_size, args):
                    result.update(lengths=kind, total_events=generated["events"], total_bytes=generated["bytes"],
                                  share_bytes=generated["bytes"] / world_size, largest_group_bytes=largest)
                    rows.append(result)
                    read = f"read {result['bytes_read'] / 2**20:7.1f} MiB of share {result['share_bytes'] / 2**20:7.1f} MiB "
                    if result["epochs"] == 0:  # stopped by --seconds within the first epoch: no share to compare with
                        read += f"(a partial pass: {result['batches']:,} of {result['batches_per_epoch']:,} batches)"
                    else:
                        read += (f"(beyond it: {(result['bytes_read'] - result['share_bytes']) / largest:+.2f} x the largest row group, "
                                 f"{largest / 2**20:.2f} MiB)")
                    print(
                        f"{kind:6s} {generated['events']:>13,} W={world_size} rank {result['rank']}: peak RSS +{result['peak_rss_mib']:7.1f} MiB, "
                        f"first batch {result['first_batch_s']:5.2f} s, {result['events_per_s'] / 1e6:5.2f} M events/s, {read}", flush=True,
                    )
            if not (args.keep or reused):  # a reused directory stays for the next --reuse
                shutil.rmtree(directory)
    print(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}))


if __name__ == "__main__":
    main()
