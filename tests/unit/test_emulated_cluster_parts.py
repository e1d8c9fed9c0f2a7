"""benchmarks/emulated/ without root: the configuration and workload registries, the options, the report.

The full run (namespaces, shaping, two torchrun launches) is tests/integration/test_emulated_cluster_integration.py.
"""

from __future__ import annotations

from types import ModuleType

import _workload
import emulated.configs
import emulated.prediction
import emulated.report
import emulated.runs
import emulated_cluster
import pytest



@pytest.fixture
def bench() -> dict[str, ModuleType]:
    """The benchmark modules under test by name (benchmarks/ is on pytest's pythonpath, as their siblings expect)."""
    return {m.__name__: m for m in (emulated_cluster, emulated.configs, emulated.report, emulated.runs, emulated.prediction, _workload)}


def _result(step_s: float, inter_bytes: float) -> dict:
    return {
        "step_time_s": step_s, "config": {"global_batch_size": 512},
        "bytes_per_step_rank0": {"inter_node": inter_bytes, "intra_node": 2 * inter_bytes},
        "traffic_per_step_rank0": [{"purpose": "replica_sync", "inter_node_bytes": inter_bytes}],
    }  # fmt: skip


def test_the_default_selection_is_every_configuration_but_the_ones_off_by_default(bench):
    configs = bench["emulated.configs"]
    assert len({c.name for c in configs.CONFIGS}) == len(configs.CONFIGS)
    args = bench["emulated_cluster"].parse_args([])
    assert [c.name for c in args.selected] == [c.name for c in configs.CONFIGS if c.name not in configs.DEFAULT_OFF]
    assert args.workload == configs.DEFAULT_WORKLOAD


def test_a_workload_passes_its_options_to_the_job(bench):
    configs, cli = bench["emulated.configs"], bench["emulated_cluster"]
    args = cli.parse_args(["--configs", "2d_touched", "--tables", "2", "--table-rows", "64"])
    argv = configs.WORKLOADS[args.workload].job_argv(args)
    assert argv == bench["_workload"].workload_argv(args) and argv[argv.index("--tables") + 1] == "2"
    assert configs.WORKLOADS[args.workload].model_json(args)["table_rows"] == [64, 64]
    with pytest.raises(SystemExit):
        cli.parse_args(["--workload", "no_such_workload"])


def test_the_report_measures_every_configuration_against_the_fastest_unshaped_step(bench):
    configs, report, runs = bench["emulated.configs"], bench["emulated.report"], bench["emulated.runs"]
    by_name = {c.name: c for c in configs.CONFIGS}
    rows = [
        report.Row(by_name["1d_fp32"], runs.combine_repeats([_result(0.30, 6e5), _result(0.20, 6e5)]), _result(0.10, 0)),
        report.Row(by_name["2d_touched"], _result(0.12, 1e5), _result(0.11, 0)),
    ]
    assert report.common_baseline(rows) == ("1d_fp32", 0.10)
    assert rows[0].cluster["step_time_s"] == 0.20  # the fastest repeat
    verdict = report.target_verdict(rows)
    assert verdict["best_2d_config"] == "2d_touched" and verdict["ratio"] == pytest.approx(1.2) and verdict["met"]
    table = report.markdown_table(rows)
    assert "| 2D touched sync | 2 x 2 | 120 | 110 | **1.20** |" in table and "| 1D FP32 | 4 x 1 | 200 | 100 | **2.00** |" in table


def test_the_sequence_workload_runs_1d_with_and_without_dedup_and_the_2d_the_cost_model_ranks_best(bench):
    configs, cli, prediction = bench["emulated.configs"], bench["emulated_cluster"], bench["emulated.prediction"]
    args = cli.parse_args(["--workload", "sequence"])
    names = [c.name for c in args.selected]
    assert names[:3] == ["1d_fp32", "1d_dedup_fp32", "1d_dedup_fp8"] and len(names) == 4
    assert args.global_batch_size == 256 and args.history_length == 64 and args.items == 1_000_000
    by_name = {c.name: c for c in configs.CONFIGS}
    candidates = [by_name[n] for n in configs.WORKLOADS["sequence"].two_d_candidates]
    link = prediction.emulated_link_cluster(args.bandwidth_mbit, args.latency_ms, args.mtu)
    estimates = {c.name: prediction.predict(args.cost_shape, c, link, args.predict_compute_ms / 1e3) for c in candidates}
    fastest = min(e.step_s for e in estimates.values())
    tied = {n: e.inter_node_bytes for n, e in estimates.items() if e.step_s <= fastest + 1e-6}
    assert names[3] == min(tied, key=tied.get)  # the shortest predicted step; among equal ones the fewest bytes across nodes
    # With little compute the overlapped syncs no longer hide, and the steps themselves decide.
    short = {c.name: prediction.predict(args.cost_shape, c, link, 1e-3).step_s for c in candidates}
    assert prediction.best_2d(args.cost_shape, candidates, link, 1e-3).name == min(short, key=short.get)
    # The model sees dedup: fewer bytes for the deduped 1D, so a shorter predicted step.
    one_d = {n: prediction.predict(args.cost_shape, by_name[n], link, 0.1) for n in names[:3]}
    assert one_d["1d_dedup_fp32"].inter_node_bytes < 0.5 * one_d["1d_fp32"].inter_node_bytes
    assert one_d["1d_dedup_fp8"].step_s < one_d["1d_dedup_fp32"].step_s < one_d["1d_fp32"].step_s


def test_the_sequence_workload_passes_its_model_and_dedup_to_the_job(bench, tmp_path):
    configs, cli, runs = bench["emulated.configs"], bench["emulated_cluster"], bench["emulated.runs"]
    args = cli.parse_args(["--workload", "sequence", "--configs", "1d_dedup_fp8,2d_touched", "--history-length", "8", "--items", "500"])
    job = runs.job_arguments(_FakeEnv(), args.selected[0], args, tmp_path / "r.json")
    assert job[job.index("--workload") + 1] == "sequence" and job[job.index("--history-length") + 1] == "8"
    assert job[job.index("--items") + 1] == "500" and "--index-dedup" in job and job[job.index("--qcomms") + 1] == "fp8"
    assert "--no-index-dedup" in runs.job_arguments(_FakeEnv(), args.selected[1], args, tmp_path / "r.json")
    assert configs.WORKLOADS["sequence"].model_json(args)["history_length"] == 8
    with pytest.raises(SystemExit):
        cli.parse_args(["--workload", "sequence", "--embedding-dim", "10"])  # not a multiple of 4


class _FakeEnv:
    shaped_links = ()
