"""``emulated_cluster.py --trace``: which run is profiled and what its job is told (no root needed)."""

from __future__ import annotations

from types import ModuleType

import _bench_job
import emulated.configs
import emulated.network
import emulated.runs
import emulated_cluster
import pytest



@pytest.fixture
def bench() -> dict[str, ModuleType]:
    """The benchmark modules under test by name (benchmarks/ is on pytest's pythonpath, as their siblings expect)."""
    return {m.__name__: m for m in (emulated_cluster, emulated.configs, emulated.network, emulated.runs, _bench_job)}


def test_only_the_traced_configurations_shaped_cluster_run_writes_a_trace(bench, tmp_path):
    args = bench["emulated_cluster"].parse_args(["--configs", "1d_fp32,2d_touched", "--trace", "2d_touched", "--trace-dir", str(tmp_path)])
    environment = bench["emulated.network"].Environment
    where = {"node_namespaces": ("n0", "n1"), "master_addr": "10.0.0.1", "ifnames": ("v0", "v1")}
    cluster = environment(name="cluster", shaped_links=(("n0", "v0"),), **where)
    reference = environment(name="reference", **where)
    configs = {c.name: c for c in bench["emulated.configs"].CONFIGS}
    runs = bench["emulated.runs"]
    job = runs.job_arguments(cluster, configs["2d_touched"], args, tmp_path / "out.json")
    assert job[job.index("--trace-dir") + 1] == str(tmp_path / "2d_touched")
    assert "--trace-dir" not in runs.job_arguments(reference, configs["2d_touched"], args, tmp_path / "out.json")
    assert "--trace-dir" not in runs.job_arguments(cluster, configs["1d_fp32"], args, tmp_path / "out.json")
    # The job parses what it is given (its own parser, as torchrun would start it).
    assert bench["_bench_job"].parse_args(job).trace_dir == str(tmp_path / "2d_touched")


def test_trace_must_name_a_configuration_that_runs(bench, capsys):
    with pytest.raises(SystemExit):
        bench["emulated_cluster"].parse_args(["--configs", "1d_fp32", "--trace", "2d_touched"])
    assert "--trace='2d_touched' must be one of the configurations run" in capsys.readouterr().err
