"""``prepare`` at scale: generate raw string-id events, prepare them under DuckDB's memory limit, print the cost.

    python benchmarks/prepare_scale.py --events 10000000
    python benchmarks/prepare_scale.py --events 100000000 --work-dir /big/disk/prepare_scale

Writes ``--events`` synthetic raw events (Zipf items, lognormal Beauty-like history lengths,
string ids, shuffled within 1e6-event chunks; ``lightning_recsys.data.parquet.synthetic_events``)
to ``WORK/raw.parquet``, then runs ``lightning-recsys prepare`` on it in a child process with
``--memory-limit`` (2GB by default) and prints the wall time, events per second and the child's
peak RSS (``ru_maxrss`` of the waited child: DuckDB's buffers plus Python's). The raw file is
reused when it already holds the asked events, so a rerun times ``prepare`` alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from lightning_recsys.data.parquet.synthetic_events import SyntheticEventsConfig, generate_events

_CHILD = "import sys; from lightning_recsys.cli.prepare import prepare_main; sys.exit(prepare_main(sys.argv[1:]))"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/prepare_scale"))
    parser.add_argument("--memory-limit", default="2GB")
    parser.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: every core)")
    parser.add_argument("--num-items", type=int, default=1_000_000)
    parser.add_argument("--mean-length", type=float, default=9.0)
    parser.add_argument("--min-item-count", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the prepared directory")
    args = parser.parse_args(argv)
    if args.events < 1:
        parser.error(f"--events={args.events} must be >= 1")

    raw = args.work_dir / f"raw-{args.events}-{args.num_items}-{args.mean_length:g}.parquet"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    generate_s = 0.0
    if not raw.is_file() or pq.ParquetFile(raw).metadata.num_rows != args.events:
        start = time.perf_counter()
        counts = generate_events(
            raw, SyntheticEventsConfig(num_events=args.events, num_items=args.num_items, mean_length=args.mean_length, string_ids=True)
        )
        generate_s = time.perf_counter() - start
        print(f"generated {counts['events']} events of {counts['users']} users in {generate_s:.1f} s ({raw.stat().st_size / 2**20:.0f} MiB)", flush=True)

    output = args.work_dir / "prepared"
    shutil.rmtree(output, ignore_errors=True)
    command = [
        sys.executable, "-c", _CHILD, "--input", str(raw), "--output", str(output), "--time-column", "ts",
        "--memory-limit", args.memory_limit, "--min-item-count", str(args.min_item_count),
    ]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    start = time.perf_counter()
    result = subprocess.run(command, check=False)
    seconds = time.perf_counter() - start
    if result.returncode:
        print(f"prepare failed with exit code {result.returncode}", file=sys.stderr)
        return result.returncode
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    metadata = json.loads((output / "metadata.json").read_text())
    prepared_mib = sum(p.stat().st_size for p in output.rglob("*") if p.is_file()) / 2**20
    numbers = {
        "events": args.events,
        "users": metadata["num_users"],
        "items": metadata["num_items"],
        "files": len(metadata["files"]),
        "row_groups": sum(len(f["row_groups"]) for f in metadata["files"]),
        "memory_limit": args.memory_limit,
        "prepare_s": round(seconds, 1),
        "events_per_s": round(args.events / seconds),
        "peak_rss_mib": round(peak_mib),
        "raw_mib": round(raw.stat().st_size / 2**20),
        "prepared_mib": round(prepared_mib),
        "generate_s": round(generate_s, 1),
    }
    print(json.dumps(numbers, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(numbers, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(output, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
