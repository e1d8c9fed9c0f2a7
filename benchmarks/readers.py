"""How fast each Criteo reader feeds one rank: lines/s and examples/s, and what a Terabyte epoch would take.

Generates a Criteo-format TSV of ``--lines`` lines (10^6 by default: 25% positives, 20% of the
integers and 10% of the categoricals missing, some negative integers, 8-digit hex values), its gzip
copy, and TorchRec's npy files (with ``convert_tsv_to_npy``, timed too). Then it iterates one rank's
train DataLoader (world size 1, ``global_batch_size`` 2048, 26 tables of 10^5 rows) for:

* ``python``: ``CriteoDataModule(reader="python")``, the line-by-line reader, on the first
  ``--python-lines`` lines (it is slow); every rank of a job reads and checks every line;
* ``arrow`` / ``arrow_gzip``: the default ``CriteoDataModule`` (pyarrow) on the plain / gzip file;
  a rank reads only its own share of the lines;
* ``npy``: ``CriteoBinaryDataModule`` on the converted files; a rank maps only its own rows;

each with ``num_workers`` 0 (the default: the rank's own process), 1 and 2. Wall-clock rates depend
on what else runs on the machine, so each run also reports its CPU-seconds (this process, its
threads and its finished workers) and lines per CPU-second; the JSON records the load average.
A Criteo Terabyte
epoch is about 4.37e9 lines (TorchRec's ``TOTAL_TRAINING_SAMPLES``, 4,195,197,692 for days 0-22, plus
day 23's roughly 1.8e8);
``terabyte_epoch_hours`` is that over the rate, for one rank. With ``W`` ranks the arrow and npy
readers divide it by ``W``; the python reader does not (each rank still reads every line).

    python benchmarks/readers.py                      # JSON in benchmarks/results/readers.json
    python benchmarks/readers.py --lines 20000 --python-lines 5000 --workers 0 --json /tmp/r.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TERABYTE_LINES = 4.37e9  # days 0-23 of Criteo Terabyte, about
GLOBAL_BATCH = 2048
TABLE_ROWS = 100_000
RESULTS = Path(__file__).resolve().parent / "results"


def generate(path: Path, lines: int, seed: int = 0) -> None:
    """A Criteo-format TSV, written by pyarrow's CSV writer in slices of 2^18 lines."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv

    rng = np.random.default_rng(seed)
    hexdigits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    options = pa_csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    names = [str(i) for i in range(40)]
    with pa_csv.CSVWriter(str(path), pa.schema([(n, pa.int64() if int(n) <= 13 else pa.string()) for n in names]), write_options=options) as writer:
        for start in range(0, lines, 1 << 18):
            n = min(1 << 18, lines - start)
            columns = [pa.array((rng.random(n) < 0.25).astype(np.int64))]
            for _ in range(13):
                values = np.floor(rng.lognormal(1.5, 2.0, n)).astype(np.int64) - (rng.random(n) < 0.05) * 3
                columns.append(pa.array(values, mask=rng.random(n) < 0.2))
            for _ in range(26):
                words = rng.integers(0, 2**32, n, dtype=np.uint64)
                shifts = np.arange(28, -1, -4, dtype=np.uint64)
                digits = hexdigits[((words[:, None] >> shifts) & np.uint64(15)).astype(np.intp)]
                offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
                valid = np.packbits(rng.random(n) >= 0.1, bitorder="little")
                columns.append(
                    pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(digits.tobytes()), pa.py_buffer(valid))
                )
            writer.write_table(pa.table(columns, names=names))


def _head(src: Path, dst: Path, lines: int) -> None:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for _, line in zip(range(lines), fin):
            fout.write(line)


def _cpu_model() -> str:
    """The CPU's model name (rates differ across machines of the same core count), or the platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the DataLoader's workers, once joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _time_loader(datamodule, lines: int) -> dict:
    loader = datamodule.train_dataloader()
    cpu, start = _cpu_seconds(), time.perf_counter()
    examples = batches = 0
    for batch in loader:
        examples += batch.batch_size
        batches += 1
    seconds = time.perf_counter() - start
    del loader
    cpu = _cpu_seconds() - cpu
    return {
        "lines": lines,
        "examples": examples,
        "batches": batches,
        "seconds": round(seconds, 3),
        "lines_per_s": round(lines / seconds),
        "examples_per_s": round(examples / seconds),
        "terabyte_epoch_hours": round(TERABYTE_LINES / (lines / seconds) / 3600, 2),
        # CPU-seconds spent (all threads and workers): less sensitive to other load on the machine.
        "cpu_seconds": round(cpu, 3),
        "lines_per_cpu_s": round(lines / cpu) if cpu > 0 else None,
    }


def profile_stages(path: Path, window_bytes: int) -> dict:
    """CPU-seconds per 10^6 lines of each stage of the arrow reader's fast path, in one thread, on ``path``.

    The stages run one after another on each window (no overlap), so they add up to one thread's
    cost of a line; the reader spreads them over ``parse_threads`` threads.
    """
    from lightning_recsys.data.criteo.arrow import whole_batches
    from lightning_recsys.data.criteo.parse import _ALLOWED, _CONVERT_FIXED, Parsed, _fixed_width_columns, _integers, _read, dense_values

    stages = dict.fromkeys(["allowed_bytes_check", "pyarrow_read_csv", "integers_to_numpy", "checks_and_hex_decode",
                            "modulo_table_size", "dense_log_transform", "batches_to_kjt"], 0.0)
    sizes = np.full(26, TABLE_ROWS, dtype=np.uint64)
    total = 0
    dense_values(np.zeros((1, 13), dtype=np.int64))  # builds its lookup table once

    def timed(name: str, fn, *args):
        start = time.thread_time()
        out = fn(*args)
        stages[name] += time.thread_time() - start
        return out

    with open(path, "rb") as f:
        carry = b""
        while block := f.read(window_bytes):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            data, carry = data[:cut], data[cut:]
            lines = data.count(b"\n")
            total += lines
            assert not timed("allowed_bytes_check", data.translate, None, _ALLOWED)
            table = timed("pyarrow_read_csv", _read, data, lines, _CONVERT_FIXED, False)
            timed("integers_to_numpy", _integers, table, lines)  # done again inside the next stage, subtracted there
            raw = timed("checks_and_hex_decode", _fixed_width_columns, table, lines, data.count(b"-"))
            ids = timed("modulo_table_size", lambda: (raw.hex_values % sizes[:, None]).view(np.int64))
            dense = timed("dense_log_transform", dense_values, raw.integers)
            parsed = Parsed(labels=raw.positive.astype(np.float32), dense=dense, ids=ids, present=raw.present)
            timed("batches_to_kjt", whole_batches, parsed, 0, lines // GLOBAL_BATCH, GLOBAL_BATCH)
    stages["checks_and_hex_decode"] -= stages["integers_to_numpy"]
    per_million = {name: round(seconds / total * 1e6, 3) for name, seconds in stages.items()}
    per_million["total"] = round(sum(per_million.values()), 3)
    return {"lines": total, "window_bytes": window_bytes, "cpu_seconds_per_1e6_lines": per_million}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines of the generated file")
    parser.add_argument("--python-lines", type=int, default=200_000, help="lines the slow line-by-line reader reads")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader num_workers to try")
    parser.add_argument("--readers", nargs="+", default=["python", "arrow", "arrow_gzip", "npy"])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=RESULTS / "readers.json")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-stage CPU profile of the arrow reader")
    args = parser.parse_args(argv)

    from lightning_recsys.data import CriteoBinaryDataModule, CriteoDataModule
    from lightning_recsys.data.criteo.binary import convert_tsv_to_npy

    work = Path(tempfile.mkdtemp(prefix="readers-")) if args.dir is None else args.dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        tsv = work / "day_0.tsv"
        start = time.perf_counter()
        generate(tsv, args.lines)
        print(f"generated {args.lines} lines ({tsv.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - start:.1f} s", flush=True)
        files = {"arrow": tsv}
        if "python" in args.readers:
            files["python"] = work / "head.tsv"
            _head(tsv, files["python"], min(args.python_lines, args.lines))
        if "arrow_gzip" in args.readers:
            files["arrow_gzip"] = work / "day_0.gz"
            with open(tsv, "rb") as fin, gzip.open(files["arrow_gzip"], "wb", compresslevel=1) as fout:
                shutil.copyfileobj(fin, fout, 16 << 20)
        conversion = None
        if "npy" in args.readers:
            start = time.perf_counter()
            rows = convert_tsv_to_npy(str(tsv), str(work / "npy"), 0, progress=False)
            seconds = time.perf_counter() - start
            conversion = {"lines": rows, "seconds": round(seconds, 3), "lines_per_s": round(rows / seconds)}
            print(f"converted to npy: {rows} lines in {seconds:.1f} s ({rows / seconds:,.0f} lines/s)", flush=True)

        profile = None
        if not args.no_profile:
            from lightning_recsys.data.criteo.arrow import DEFAULT_WINDOW_BYTES

            profile = profile_stages(tsv, DEFAULT_WINDOW_BYTES)
            print("arrow reader, CPU-s per 10^6 lines by stage (one thread):", json.dumps(profile["cpu_seconds_per_1e6_lines"]), flush=True)
        sizes = TABLE_ROWS
        runs = []
        for reader in args.readers:
            lines = min(args.python_lines, args.lines) if reader == "python" else args.lines
            for workers in args.workers:
                if reader == "npy":
                    dm = CriteoBinaryDataModule(str(work / "npy"), train_days=[0], table_sizes=sizes, global_batch_size=GLOBAL_BATCH, num_workers=workers)
                else:
                    dm = CriteoDataModule(
                        [str(files[reader])], table_sizes=sizes, global_batch_size=GLOBAL_BATCH,
                        reader="python" if reader == "python" else "arrow", num_workers=workers,
                    )
                result = {"reader": reader, "num_workers": workers, **_time_loader(dm, lines)}
                result["ranks_share_lines"] = reader != "python"
                runs.append(result)
                print(
                    f"{reader:>10}  workers={workers}  {result['lines_per_s']:>10,} lines/s  {result['examples_per_s']:>10,} examples/s"
                    f"  Terabyte epoch on one rank: {result['terabyte_epoch_hours']:.2f} h",
                    flush=True,
                )
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    def best(reader: str) -> int | None:
        rates = [r["lines_per_s"] for r in runs if r["reader"] == reader]
        return max(rates) if rates else None

    default = {r["reader"]: r["lines_per_s"] for r in runs if r["num_workers"] == 0}
    summary = {
        "arrow_over_python_default": round(default["arrow"] / default["python"], 1) if {"arrow", "python"} <= default.keys() else None,
        "arrow_lines_per_s_default": default.get("arrow"),
        "npy_examples_per_s_default": default.get("npy"),
        "best_lines_per_s": {reader: best(reader) for reader in args.readers},
        "targets": {"arrow_lines_per_s": 870_000, "npy_examples_per_s": 1_000_000},
    }
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    result = {
        "benchmark": "readers",
        "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "load_average_1_5_15": load, "python": platform.python_version()},
        "global_batch_size": GLOBAL_BATCH,
        "table_rows": TABLE_ROWS,
        "terabyte_lines": TERABYTE_LINES,
        "npy_conversion": conversion,
        "arrow_stage_profile": profile,
        "runs": runs,
        "summary": summary,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
