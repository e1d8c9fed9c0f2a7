"""Two "nodes" on one machine: network namespaces, a shaped link between them, and the step time on it.

    sudo python benchmarks/emulated_cluster.py --skip-unavailable    # every default configuration the install supports
    sudo python benchmarks/emulated_cluster.py --bandwidth-mbit 100 --latency-ms 2 --skip-unavailable
    sudo python benchmarks/emulated_cluster.py --configs 1d_fp32,2d_touched_sync4 --steps 16
    sudo python benchmarks/emulated_cluster.py --workload pretrain --repeats 3 --warmup-steps 4 --steps 16

``--workload sequence`` trains a ``SequenceRanker`` instead (``_sequence_workload.py``) and ``--workload pretrain`` a
``SequencePretrainer`` on Beauty-like sequences (``_pretrain_workload.py``); both run 1D FP32, 1D with index dedup in
FP32 and FP8, and the 2D configuration the cost model ranks best, print the cost model's prediction before the runs
and the measurement beside it after them, and with ``--repeats`` > 1 say in how many repeats each statement held.
By default every configuration trains the same DLRM (synthetic click logs with Zipf ids, 8 tables of 10^5 to
10^6 rows built on meta, dim 16, table-wise sharding) with the same global batch on the same 4
processes: 2 nodes x 2 ranks, two ``torchrun --nnodes 2`` launches. The configurations: 1D (FP32,
FP8 QComms) and 2D all-to-all optimized with touched-row replica sync every 1 and 4 steps, blocking
or overlapped, fp32 or bf16 deltas (``ReplicaSyncConfig``); ``--skip-unavailable`` leaves out the
ones the installed version refuses. Each runs twice:

* **emulated cluster**: each node's ranks run in the node's own network namespace. Ranks of a node
  talk over the namespace's loopback (a connection to a local address never leaves the kernel), so
  intra-node traffic is unshaped. Traffic between nodes leaves through the node's veth, which is
  shaped with ``tc``: a TBF at ``--bandwidth-mbit`` on each node's egress, plus a fixed one-way
  ``--latency-ms`` delay (netem when the kernel has it, else ``_delay_line.py``, a TUN device in
  the router namespace that holds each packet for the delay)::

        node 0 ns                     router ns                       node 1 ns
      [r0 r1] lo       veth(tbf) <-> [ip_forward, delay] <-> veth(tbf)   [r2 r3] lo
      10.213.0.2                 10.213.0.1 | 10.213.1.1                 10.213.1.2

* **reference**: the same two launches in one namespace on its loopback, with no shaping. The
  strategy is told the same 2 nodes x 2 ranks, so its layout (groups, plan) is identical.

The headline is each configuration's step time on the emulated cluster divided by **one common
baseline**: the fastest unshaped step of any configuration (a configuration whose own unshaped step
is slow, e.g. from a CPU codec, gets no credit for it). Target: the best 2D configuration within
1.25x. Also reported: the step against the configuration's own unshaped step (the network penalty,
which the cost model validates), rank 0's rows and bytes per replica sync (``strategy.replica_sync_stats``)
and its bytes per step inside and across nodes from ``strategy.comm_accounting``. Prints a Markdown table, writes JSON
(default ``benchmarks/results/emulated_cluster.json``) and, when matplotlib is installed, a PNG.

Needs root, iproute2 (``ip``, ``tc``) and TBF in the kernel (and netem or /dev/net/tun for the
latency). It creates its namespaces (named ``lrsec<pid>-...``, addresses in 10.213.0.0/16 that
exist only inside them) and removes them, and every process it started in them, on exit, failure,
Ctrl-C or SIGTERM. Namespaces left by a run that was killed with SIGKILL are removed by the next run.
"""

# The parts live in benchmarks/emulated/: configs.py (the configurations and the workloads; a new one is
# one more entry there), network.py (namespaces and shaping), runs.py (one run) and report.py.
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _pretrain_workload as pretrain
import _sequence_workload as sequence
from _workload import add_workload_arguments, table_sizes
from emulated.configs import CONFIGS, DEFAULT_OFF, DEFAULT_WORKLOAD, NODES, RANKS_PER_NODE, WORKLOADS, unavailable_reason
from emulated.network import SetupError, add_link_arguments, build_cluster, build_reference, preflight, remove_stale_namespaces, sandbox_guard
from emulated.report import Row, print_results, results_payload, write_png
from emulated.runs import combine_repeats, print_run, run_job

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_link_arguments(parser)
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset of: " + ", ".join(c.name for c in CONFIGS) + f" (default: all but {', '.join(DEFAULT_OFF)}; "
        "--workload sequence or pretrain: 1d_fp32, 1d_dedup_fp32, 1d_dedup_fp8 and the 2D configuration the cost model ranks best)",
    )
    parser.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="leave out configurations whose sync settings the installed ReplicaSyncConfig refuses (e.g. not implemented yet)",
    )
    parser.add_argument(
        "--workload", default=DEFAULT_WORKLOAD, choices=sorted(WORKLOADS), help="the model and data every configuration trains"
    )
    add_workload_arguments(
        parser, table_rows="1000000,500000,200000,100000", steps_help="timed steps (a multiple of every config's sync interval)"
    )
    sequence.add_sequence_arguments(parser)
    pretrain.add_pretrain_arguments(parser)
    parser.add_argument(
        "--predict-compute-ms", type=float, default=150.0,
        help="--workload sequence or pretrain: the compute per step the cost model assumes before the run (after it, the measured unshaped steps)",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of every (config, environment), in alternating order; the fastest is reported"
    )
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds for one launch pair, start-up included")
    parser.add_argument(
        "--phase-times", action="store_true", help="also time each step's phases on rank 0 (_bench_job.py --phase-times), printed per run"
    )
    parser.add_argument(
        "--trace", default=None, metavar="CONFIG",
        help="save a torch.profiler trace of every rank of this configuration's shaped-cluster runs (steps 3-5) under --trace-dir",
    )
    parser.add_argument("--trace-dir", type=Path, default=RESULTS / "emulated_cluster_traces", help="where --trace writes (default %(default)s)")
    parser.add_argument("--json", type=Path, default=RESULTS / "emulated_cluster.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "emulated_cluster.png")
    parser.add_argument("--no-png", action="store_true")
    known, _ = parser.parse_known_args(argv)
    workload = WORKLOADS.get(known.workload)
    if workload is not None:
        parser.set_defaults(**workload.defaults)
    args = parser.parse_args(argv)
    args.cost_shape = None
    if args.workload == "sequence":
        try:
            sequence.check_sequence_arguments(args)
        except ValueError as exc:
            parser.error(str(exc))
        args.cost_shape = sequence.model_shape(args, NODES * RANKS_PER_NODE, sequence.dense_param_bytes(args))
    if args.workload == "pretrain":
        try:
            pretrain.check_pretrain_arguments(args)
        except ValueError as exc:
            parser.error(str(exc))
        args.cost_shape = pretrain.model_shape(args, NODES * RANKS_PER_NODE)  # learned from the workload's own batches
    if args.configs is None:
        args.configs = ",".join(_default_configs(args))
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CONFIGS})
    if unknown or not names:
        parser.error(f"--configs={args.configs!r}: unknown {unknown}; choose from {[c.name for c in CONFIGS]}")
    args.selected = [c for c in CONFIGS if c.name in names]
    if args.trace is not None and args.trace not in names:
        parser.error(f"--trace={args.trace!r} must be one of the configurations run (--configs): {names}")
    args.skipped = []
    refused = [(c, why) for c in args.selected if (why := unavailable_reason(c)) is not None]
    if refused and not args.skip_unavailable:
        parser.error(
            "the installed ReplicaSyncConfig refuses: "
            + "; ".join(f"{c.name} ({why})" for c, why in refused)
            + ". Pass --skip-unavailable to run the others, or leave these out of --configs."
        )
    args.skipped = [{"config": c.name, "reason": why} for c, why in refused]
    args.selected = [c for c in args.selected if all(c is not r for r, _ in refused)]
    if not args.selected:
        parser.error("no configuration left to run")
    try:
        table_sizes(args.table_rows, args.tables)
    except ValueError as exc:
        parser.error(str(exc))
    for cfg in args.selected:
        if args.steps % cfg.sync_every_n_steps or args.warmup_steps % cfg.sync_every_n_steps:
            parser.error(
                f"--steps={args.steps} and --warmup-steps={args.warmup_steps} must be multiples of {cfg.sync_every_n_steps} ({cfg.name})"
            )
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.bandwidth_mbit <= 0 or args.latency_ms < 0:
        parser.error("--bandwidth-mbit must be > 0 and --latency-ms >= 0")
    return args


def _default_configs(args: argparse.Namespace) -> list[str]:
    """The workload's default configurations, with the 2D one the cost model ranks best on this link where it names candidates."""
    workload = WORKLOADS[args.workload]
    if workload.default_configs is None:
        return [c.name for c in CONFIGS if c.name not in DEFAULT_OFF]
    names = list(workload.default_configs)
    if workload.two_d_candidates and args.cost_shape is not None:
        from emulated.prediction import best_2d, emulated_link_cluster

        candidates = [c for c in CONFIGS if c.name in workload.two_d_candidates and unavailable_reason(c) is None]
        cluster = emulated_link_cluster(args.bandwidth_mbit, args.latency_ms, args.mtu)
        names.append(best_2d(args.cost_shape, candidates, cluster, args.predict_compute_ms / 1e3).name)
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preflight(args.latency_ms, args.delay_method)
    except SetupError as exc:
        print(f"emulated_cluster: cannot run here: {exc}", file=sys.stderr)
        return 2
    log_dir = args.json.parent / "emulated_cluster_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    rows: list[Row] = []
    errors: list[str] = []
    with sandbox_guard() as sandbox:
        stale = remove_stale_namespaces()
        if stale:
            print(f"removed namespaces left by earlier killed runs: {stale}")
        try:
            cluster, shaping = build_cluster(
                sandbox, bandwidth_mbit=args.bandwidth_mbit, latency_ms=args.latency_ms, mtu=args.mtu, delay_method=args.delay_method
            )
            reference = build_reference(sandbox)
        except SetupError as exc:
            print(f"emulated_cluster: cannot build the emulated network: {exc}", file=sys.stderr)
            return 2
        for skipped in args.skipped:
            print(f"skipped {skipped['config']}: {skipped['reason']}")
        print(
            f"Emulated cluster: {NODES} nodes x {RANKS_PER_NODE} ranks; between nodes {shaping.bandwidth_mbit:g} Mbit/s per "
            f"direction (TBF), {shaping.latency_ms:g} ms one-way ({shaping.delay_method}), MTU {shaping.mtu}; inside a node: loopback, unshaped.\n"
            + WORKLOADS[args.workload].describe(args),
            flush=True,
        )
        before = None
        if args.cost_shape is not None:
            from emulated.prediction import emulated_link_cluster, print_prediction

            link = emulated_link_cluster(shaping.bandwidth_mbit, shaping.latency_ms, shaping.mtu)
            before = print_prediction(args.cost_shape, args.selected, link, args.predict_compute_ms / 1e3)
        port = 29610
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for repeat in range(args.repeats):
            for i, cfg in enumerate(args.selected):
                # Alternate the order so slow drift of a shared machine's load hits both sides alike.
                for env in (cluster, reference) if (i + repeat) % 2 == 0 else (reference, cluster):
                    port += 1
                    side = "cluster" if env is cluster else "reference"
                    try:
                        result = run_job(env, cfg, args, port=port, out_json=log_dir / f"{cfg.name}.{port}.json", log_dir=log_dir)
                    except RuntimeError as exc:
                        errors.append(str(exc))
                        print(f"FAILED {exc}", file=sys.stderr, flush=True)
                        continue
                    runs.setdefault((cfg.name, side), []).append(result)
                    print_run(cfg, env, result)
        for cfg in args.selected:
            if (cfg.name, "cluster") in runs and (cfg.name, "reference") in runs:
                rows.append(Row(cfg, combine_repeats(runs[(cfg.name, "cluster")]), combine_repeats(runs[(cfg.name, "reference")])))
    elapsed = time.monotonic() - started

    if rows:
        verdict = print_results(rows, args, elapsed=elapsed, load_before=load_before)
        payload = results_payload(rows, args, shaping=shaping, elapsed=elapsed, load_before=load_before, verdict=verdict, errors=errors)
        if args.cost_shape is not None and before is not None:
            from emulated.prediction import emulated_link_cluster, print_comparison, print_repeats

            link = emulated_link_cluster(shaping.bandwidth_mbit, shaping.latency_ms, shaping.mtu)
            payload["cost_model"] = print_comparison(args.cost_shape, rows, link, before)
            payload["cost_model"]["repeats"] = print_repeats(args.cost_shape, runs, args.selected, link)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
        if not args.no_png:
            problem = write_png(rows, shaping, args.png)
            print(problem or f"wrote {args.png}")
    if args.trace is not None:
        traces = sorted((args.trace_dir / args.trace).glob("node*/*.json"))
        print(f"{len(traces)} profiler trace(s) of {args.trace} (steps 3-5 of each run, one per rank) under {args.trace_dir / args.trace}; "
              "open one in https://ui.perfetto.dev or chrome://tracing")  # fmt: skip
    if errors:
        print(f"{len(errors)} run(s) failed; see {log_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
