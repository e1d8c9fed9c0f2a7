"""Full ranking at scale: the sharded exact ranking of 1,000 users against 10^6 and 10^7 items, 2 processes.

Two processes (gloo over loopback, one thread each) build one ``EmbeddingCollection`` with an item table per
size on the meta device, shard it with ``lightning_recsys.parallel.shard_model`` (the strategy's path: TorchRec's
``DistributedModelParallel`` materialises only each rank's shards; row-wise by default), then fill every shard
with seeded random values (a block of rows at a time, the same values whatever the sharding). The width and the
``K`` are those of ``examples/configs/beauty_pretrain.yaml`` (``embedding_dim`` 64, ``K`` = the largest of its
``eval_k``, 100). The users (1,000 by default, half on each rank) have random query vectors, targets and up
to 50 seen items each. Each table is ranked by ``make_item_ranking`` over the sharding group: ``target_ranks``
(what validation and test call) and ``top_k``; the sizes take turns within each repeat, so a change in the
machine's load falls on all of them. Prints a Markdown table and writes JSON to ``benchmarks/results/``::

    python benchmarks/full_ranking_scale.py                         # 10^6 and 10^7 items, row-wise
    python benchmarks/full_ranking_scale.py --sharding column_wise --items 1000000
    python benchmarks/full_ranking_scale.py --items 10000 --users 40 --check   # ranks checked against the brute force

Time: per call, from a barrier to the call's return, the slowest rank's; the median over ``--repeats`` calls,
after ``--warmup`` calls of ``--warmup-users`` users (the same code, chunks and collectives, in less time).
Users per second: the group's users over that time. The JSON also has each call's CPU time (the busiest
rank's ``time.process_time()``), which other jobs on a shared machine change far less than the wall time.

Memory: the peak resident memory (RSS) of each rank above a baseline taken after the table is filled and the
rankings built, the allocator's free memory handed back (``malloc_trim``), so the baseline is what the
process holds for the table and everything else, and the rise above it is what the ranking needs. The peak
is the kernel's own high-water mark of the process's resident memory (``VmHWM`` in ``/proc/self/status``),
reset before every call by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0, ``proc(5)``): every page
touched in between counts, however briefly held. ``tracemalloc`` sees only Python's allocator, not tensor
memory, and ``getrusage``'s ``ru_maxrss`` cannot be reset, so a peak of building the model would hide the
ranking's. Where ``clear_refs`` cannot be written, a thread samples ``VmRSS`` every millisecond instead (the
JSON says which; a sampler can miss a shorter peak). The reported extra is the largest over a table's calls
and ranks. The table's own bytes per rank are listed beside it.

Measured with the defaults (``python benchmarks/full_ranking_scale.py``: row-wise, 1,000 users, dim 64,
K = 100, one warm-up call, the median of 2 calls) on this project's 2-core CPU machine while other jobs ran
on it (load average 6 to 10), torch 2.13 CPU, one thread per process; 10 minutes in all::

    | items      | table MiB/rank | target_ranks s | users/s | top_k (K=100) s | users/s | extra peak MiB/rank (ranks, top-K) |
    |-----------:|---------------:|---------------:|--------:|----------------:|--------:|-----------------------------------:|
    |  1,000,000 |            122 |           5.82 |     172 |           13.22 |      76 |                             57, 57 |
    | 10,000,000 |          1,221 |          76.45 |      13 |          125.19 |       8 |                             57, 57 |

    CPU time of the busiest rank per call: 2.05 s and 3.01 s at 10^6 items, 21.2 s and 29.1 s at 10^7:
    10x the items took 10.3x (target_ranks) and 9.7x (top_k) the CPU time; the wall time, which the other
    jobs' load changes, 13.1x and 9.5x.

The extra memory does not depend on the table's size: one chunk's 16 MiB score block and its mask (4,194 rows
for 1,000 queries), the candidates, and what the C allocator keeps of them between calls. Before the
chunks were bounded in bytes, the same ranking of 1,000 users held a 250 MiB block of 65,536 rows, and
reduced its boolean blocks along rows (which torch does through an int64 copy): measured in one process on
a rank's share of 10^6 items, +572 to +613 MiB (target_ranks) and +959 to +988 MiB (top_k) above the
table, against +34 to +55 MiB after, with the same ranks and top-K ids, in 38% (target_ranks) and 27%
(top_k) of the CPU time.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

from lightning_recsys.parallel import EmbeddingOptimizerConfig, ParallelTopology, make_sharders, shard_model
from lightning_recsys.parallel.ranking import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_ROWS, UnshardedItemRanking, make_item_ranking
from lightning_recsys.parallel.ranking.unsharded import rows_per_chunk
from lightning_recsys.testing.processes import run_ranks

ROOT = Path(__file__).resolve().parents[1]
BEAUTY_CONFIG = ROOT / "examples" / "configs" / "beauty_pretrain.yaml"
WORLD = 2
FILL_BLOCK_ROWS = 65_536  # rows filled from one seeded generator: the values do not depend on the shards' bounds
MIB = 2**20


def beauty_dim_and_k() -> tuple[int, int]:
    """``embedding_dim`` and the largest ``eval_k`` of the shipped Beauty pretraining config."""
    model = yaml.safe_load(BEAUTY_CONFIG.read_text())["model"]["init_args"]
    return int(model["embedding_dim"]), max(int(k) for k in model["eval_k"])


def table_name(num_items: int) -> str:
    return f"items_{num_items}"


def fill_values(seed: int, row_start: int, num_rows: int, col_start: int, width: int, dim: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, values)`` pieces of rows ``row_start ..`` and columns ``col_start ..`` of the seeded table."""
    for block in range(row_start // FILL_BLOCK_ROWS, (row_start + num_rows - 1) // FILL_BLOCK_ROWS + 1):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + block)
        values = torch.randn(FILL_BLOCK_ROWS, dim, generator=generator)
        first = max(row_start, block * FILL_BLOCK_ROWS)
        last = min(row_start + num_rows, (block + 1) * FILL_BLOCK_ROWS)
        yield first, values[first - block * FILL_BLOCK_ROWS : last - block * FILL_BLOCK_ROWS, col_start : col_start + width]


def whole_table(seed: int, num_items: int, dim: int) -> torch.Tensor:
    """The table every rank's shards are filled from, whole (for ``--check``; small tables only)."""
    return torch.cat([values for _, values in fill_values(seed, 0, num_items, 0, dim, dim)])


def users(seed: int, num_items: int, num_users: int, dim: int, max_seen: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s share of the users: query vectors, targets and seen items (``rank``'s half, in order)."""
    generator = torch.Generator().manual_seed(seed + num_items)
    queries = torch.randn(num_users, dim, generator=generator)
    targets = torch.randint(0, num_items, (num_users,), generator=generator)
    seen_lengths = torch.randint(0, max_seen + 1, (num_users,), generator=generator)
    seen_ids = torch.randint(0, num_items, (int(seen_lengths.sum()),), generator=generator)
    first, last = rank * num_users // WORLD, (rank + 1) * num_users // WORLD
    ends = seen_lengths.cumsum(0)
    seen_start, seen_end = (int(ends[first - 1]) if first else 0), (int(ends[last - 1]) if last else 0)
    return {
        "queries": queries[first:last],
        "target_ids": targets[first:last],
        "seen_ids": seen_ids[seen_start:seen_end],
        "seen_lengths": seen_lengths[first:last],
    }


def first_users(inputs: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """The first ``count`` users of ``inputs`` (a warm-up's: the same code, chunks and collectives, for less time)."""
    seen = int(inputs["seen_lengths"][:count].sum())
    return {
        "queries": inputs["queries"][:count], "target_ids": inputs["target_ids"][:count],
        "seen_ids": inputs["seen_ids"][:seen], "seen_lengths": inputs["seen_lengths"][:count],
    }


class PeakMemory:
    """This process's peak resident memory since ``reset()``, in bytes (see the module docstring)."""

    def __init__(self) -> None:
        self.method = "VmHWM reset through /proc/self/clear_refs"
        try:
            self._clear_refs()
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _clear_refs() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one (proc(5))

    @staticmethod
    def status(field: str) -> int:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
        assert match, field
        return int(match.group(1)) * 1024

    def reset(self) -> None:
        if self.method.startswith("VmHWM"):
            self._clear_refs()
            return
        self._sampled = self.status("VmRSS")
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, self.status("VmRSS"))

    def peak(self) -> int:
        if self.method.startswith("VmHWM"):
            return self.status("VmHWM")
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        return max(self._sampled, self.status("VmRSS"))


def release_free_memory() -> None:
    """Free what Python and the C allocator hold unused, so RSS is the live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may include freed memory, the baseline is then higher
        pass


def build_tables(args: argparse.Namespace, dim: int) -> tuple[nn.Module, ParallelTopology]:
    """The item tables on meta, sharded over the 2 ranks by ``shard_model`` (TorchRec's DMP materialises the shards)."""
    configs = [EmbeddingConfig(name=table_name(n), embedding_dim=dim, num_embeddings=n, feature_names=[f"f_{n}"]) for n in args.items]
    model = nn.Module()
    model.item_embeddings = EmbeddingCollection(tables=configs, device=torch.device("meta"))
    fused = EmbeddingComputeKernel.FUSED.value  # as the planner picks on CPU: FBGEMM's kernel
    placement = {
        "row_wise": lambda i: row_wise(compute_kernel=fused),
        "table_wise": lambda i: table_wise(rank=i % WORLD, compute_kernel=fused),
        "column_wise": lambda i: column_wise(ranks=list(range(WORLD)), compute_kernel=fused),
    }[args.sharding]
    topology = ParallelTopology(world_size=WORLD, sharding_group_size=WORLD)
    topology.device_mesh("cpu")
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd", lr=0.1).fused_params())
    module_plan = construct_module_sharding_plan(
        model.item_embeddings,
        {table_name(n): placement(i) for i, n in enumerate(args.items)},
        sharder=sharders[1],
        local_size=WORLD,
        world_size=WORLD,
        device_type="cpu",
    )
    plan = ShardingPlan({"item_embeddings": module_plan})
    sharded = shard_model(model, topology=topology, device=torch.device("cpu"), sharders=sharders, plan=plan)
    return sharded.dmp.module.item_embeddings, topology


def fill_tables(collection: nn.Module, args: argparse.Namespace, dim: int) -> dict[str, int]:
    """Write the seeded values into this rank's shards (the ``state_dict()``'s local shards are the module's
    own tensors); return each table's bytes on this rank."""
    state = collection.state_dict()
    held = {}
    with torch.no_grad():
        for n in args.items:
            sharded = state[f"embeddings.{table_name(n)}.weight"]
            held[table_name(n)] = 0
            for shard in sharded.local_shards():
                row, col = (int(v) for v in shard.metadata.shard_offsets)
                rows, width = shard.tensor.shape
                held[table_name(n)] += shard.tensor.numel() * shard.tensor.element_size()
                if rows == 0:
                    continue
                for first, values in fill_values(args.seed, row, rows, col, width, dim):
                    shard.tensor[first - row : first - row + values.shape[0]].copy_(values)
    # Read back through a fresh state_dict(): the values must be in the module, not in a copy.
    for n in args.items:
        for shard in collection.state_dict()[f"embeddings.{table_name(n)}.weight"].local_shards():
            row, col = (int(v) for v in shard.metadata.shard_offsets)
            if shard.tensor.shape[0]:
                _, expected = next(fill_values(args.seed, row, 1, col, shard.tensor.shape[1], dim))
                assert torch.equal(shard.tensor[:1], expected), f"table {table_name(n)}: the fill did not reach the module"
    return held


def timed_call(call: Callable[[], Any], memory: PeakMemory, baseline: int) -> tuple[Any, float, float, int]:
    """``(result, seconds, CPU seconds, peak bytes above baseline)`` of one call on this rank, from a barrier."""
    dist.barrier()
    memory.reset()
    start, start_cpu = time.perf_counter(), time.process_time()
    result = call()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    return result, seconds, cpu_seconds, memory.peak() - baseline


def _run(rank: int, world_size: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=1800))
    dim, k = args.dim, args.k
    started = time.perf_counter()
    collection, topology = build_tables(args, dim)
    built = time.perf_counter()
    held = fill_tables(collection, args, dim)
    filled = time.perf_counter()
    group = topology.sharding_process_group()
    rankings = {
        n: make_item_ranking(
            collection, table_name(n), process_group=group, chunk_rows=args.chunk_rows, normalize_rows=args.normalize_rows,
            block_bytes=args.block_bytes,
        )
        for n in args.items
    }
    inputs = {n: users(args.seed, n, args.users, dim, args.max_seen, rank) for n in args.items}
    memory = PeakMemory()
    release_free_memory()
    baseline = PeakMemory.status("VmRSS")
    warmup_inputs = {n: first_users(inputs[n], args.warmup_users // WORLD) for n in args.items}

    def target_ranks(n: int, warmup: bool) -> torch.Tensor:
        return rankings[n].target_ranks(**(warmup_inputs if warmup else inputs)[n])

    def top_k(n: int, warmup: bool) -> tuple[torch.Tensor, torch.Tensor]:
        users_now = (warmup_inputs if warmup else inputs)[n]
        return rankings[n].top_k(users_now["queries"], k, users_now["seen_ids"], users_now["seen_lengths"])

    calls = {"target_ranks": target_ranks, "top_k": top_k}
    seconds: dict[tuple[int, str], list[float]] = {(n, op): [] for n in args.items for op in calls}
    cpu_seconds: dict[tuple[int, str], list[float]] = {(n, op): [] for n in args.items for op in calls}
    extra: dict[tuple[int, str], int] = {(n, op): 0 for n in args.items for op in calls}
    results: dict[tuple[int, str], Any] = {}
    for repeat in range(args.warmup + args.repeats):
        for n in args.items:  # the sizes take turns: a change of load falls on every size
            for op, call in calls.items():
                warmup = repeat < args.warmup
                result, elapsed, cpu, rise = timed_call(lambda: call(n, warmup), memory, baseline)
                extra[(n, op)] = max(extra[(n, op)], rise)
                if not warmup:
                    results[(n, op)] = result
                    seconds[(n, op)].append(elapsed)
                    cpu_seconds[(n, op)].append(cpu)
                if rank == 0:
                    print(f"  repeat {repeat}{' (warm-up)' if repeat < args.warmup else ''}: {n:,} items, {op}: {elapsed:.2f} s, "
                          f"+{rise / MIB:.0f} MiB", flush=True)
    retained = PeakMemory.status("VmRSS") - baseline
    mine = {
        "seconds": seconds, "cpu_seconds": cpu_seconds, "extra": extra, "held": held, "baseline": baseline, "retained": retained,
        "setup_s": {"build": built - started, "fill": filled - built},
    }
    if args.check:
        mine["results"] = results
        mine["inputs"] = inputs
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"ranks": gathered, "memory_method": memory.method}, buffer)
        Path(out_path).write_bytes(buffer.getvalue())
    dist.barrier()
    dist.destroy_process_group()


def summarise(args: argparse.Namespace, ranks: list[dict[str, Any]], memory_method: str, load: dict[str, str]) -> dict[str, Any]:
    rows = []
    for n in args.items:
        row: dict[str, Any] = {
            "items": n,
            "table_mib_per_rank": [r["held"][table_name(n)] / MIB for r in ranks],
            "rows_per_chunk": rows_per_chunk(args.users, 4, args.chunk_rows, args.block_bytes),
        }
        for op in ("target_ranks", "top_k"):
            per_call = [max(r["seconds"][(n, op)][i] for r in ranks) for i in range(args.repeats)]  # the slowest rank
            median = statistics.median(per_call)
            cpu = statistics.median(max(r["cpu_seconds"][(n, op)][i] for r in ranks) for i in range(args.repeats))
            row[op] = {
                "seconds": per_call,
                "median_s": median,
                "median_cpu_s": cpu,
                "users_per_s": args.users / median,
                "ns_per_user_item": 1e9 * median / (args.users * n),
                "extra_peak_mib_per_rank": [r["extra"][(n, op)] / MIB for r in ranks],
            }
        rows.append(row)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "port")},
        "rows": rows,
        "memory_method": memory_method,
        "baseline_rss_mib_per_rank": [r["baseline"] / MIB for r in ranks],
        "retained_after_mib_per_rank": [r["retained"] / MIB for r in ranks],
        "setup_s_per_rank": [r["setup_s"] for r in ranks],
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(), **load},
    }


def markdown(summary: dict[str, Any], k: int) -> str:
    lines = [
        f"| items | table MiB/rank | target_ranks s | users/s | top_k (K={k}) s | users/s | extra peak MiB/rank (ranks, top-K) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        ranks, top = row["target_ranks"], row["top_k"]
        lines.append(
            f"| {row['items']:,} | {max(row['table_mib_per_rank']):,.0f} | {ranks['median_s']:.2f} | {ranks['users_per_s']:,.0f} | "
            f"{top['median_s']:.2f} | {top['users_per_s']:,.0f} | "
            f"{max(ranks['extra_peak_mib_per_rank']):.0f}, {max(top['extra_peak_mib_per_rank']):.0f} |"
        )
    rows = summary["rows"]
    for previous, row in zip(rows, rows[1:]):
        for op in ("target_ranks", "top_k"):
            growth = row[op]["median_s"] / previous[op]["median_s"]
            cpu_growth = row[op]["median_cpu_s"] / previous[op]["median_cpu_s"]
            lines.append(
                f"\n{op}: {row['items'] / previous['items']:.1f}x the items took {growth:.1f}x the time "
                f"({cpu_growth:.1f}x the CPU time of the busiest rank)."
            )
    return "\n".join(lines)


def check(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> list[str]:
    """Each rank's ranks and top-K ids against the brute force over the whole table; the problems found."""
    problems = []
    for n in args.items:
        reference = UnshardedItemRanking(whole_table(args.seed, n, args.dim), normalize_rows=args.normalize_rows)
        for rank, output in enumerate(ranks):
            inputs = output["inputs"][n]
            expected_ranks = reference.target_ranks(**inputs)
            _, expected_ids = reference.top_k(inputs["queries"], args.k, inputs["seen_ids"], inputs["seen_lengths"])
            if not torch.equal(output["results"][(n, "target_ranks")], expected_ranks):
                problems.append(f"{n} items, rank {rank}: target ranks differ from the brute force")
            if not torch.equal(output["results"][(n, "top_k")][1], expected_ids):
                problems.append(f"{n} items, rank {rank}: top-{args.k} ids differ from the brute force")
    return problems


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    dim, k = beauty_dim_and_k()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, nargs="+", default=[10**6, 10**7], help="table sizes (default 10^6 10^7)")
    parser.add_argument("--users", type=int, default=1000, help="users in the group, half per rank (default 1000)")
    parser.add_argument("--sharding", choices=("row_wise", "table_wise", "column_wise"), default="row_wise")
    parser.add_argument("--dim", type=int, default=dim, help=f"table width (default {dim}: beauty_pretrain.yaml's embedding_dim)")
    parser.add_argument("--k", type=int, default=k, help=f"top-K (default {k}: beauty_pretrain.yaml's largest eval_k)")
    parser.add_argument("--max-seen", type=int, default=50, help="seen items per user, drawn in 0..N (default 50)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per size and call, before the timed ones (default 1)")
    parser.add_argument("--warmup-users", type=int, default=16, help="users of a warm-up call, half per rank (default 16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per size and call (default 2)")
    parser.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="make_item_ranking's block_bytes")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS, help="make_item_ranking's chunk_rows")
    parser.add_argument("--normalize-rows", action="store_true", help="score L2-normalised rows (l2_normalize models)")
    parser.add_argument("--check", action="store_true", help="compare with the brute force over the whole table (small tables)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29563)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "full_ranking_scale.json")
    args = parser.parse_args(argv)
    if args.users < 1 or args.repeats < 1 or args.warmup < 0 or args.warmup_users < 0 or args.k < 1 or any(n < 1 for n in args.items):
        parser.error("--users, --repeats, --k and --items must be >= 1, --warmup and --warmup-users >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = {"load_before": load_average()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.pt")
        run_ranks(_run, WORLD, args, path, timeout=24 * 3600)  # forks of a server that imported torch once (spawn where CUDA is)
        gathered = torch.load(path, weights_only=False)
    load["load_after"] = load_average()
    summary = summarise(args, gathered["ranks"], gathered["memory_method"], load)
    if args.check:
        summary["check_problems"] = check(args, gathered["ranks"])
    print(markdown(summary, args.k))
    print(f"\nPeak memory: {summary['memory_method']}; load average before {load['load_before']}, after {load['load_after']}.")
    if args.check:
        problems = summary["check_problems"]
        print("check: " + ("; ".join(problems) if problems else "every rank and top-K id equals the brute force"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    if args.check and summary["check_problems"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
