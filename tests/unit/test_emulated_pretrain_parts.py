"""benchmarks/emulated_cluster.py --workload pretrain without root: the learned cost-model shape, the job's
arguments, and the per-repeat statements (the full run: tests/integration/test_emulated_pretrain_integration.py)."""

from __future__ import annotations

from types import ModuleType

import emulated.configs
import emulated.prediction
import emulated_cluster
import pytest

TINY = ["--workload", "pretrain", "--items", "5000", "--pretrain-users", "600", "--embedding-dim", "16", "--global-batch-size", "64",
        "--num-negatives", "32", "--max-length", "20"]  # fmt: skip


@pytest.fixture
def bench() -> dict[str, ModuleType]:
    """The benchmark modules under test by name (benchmarks/ is on pytest's pythonpath, as their siblings expect)."""
    return {m.__name__: m for m in (emulated_cluster, emulated.configs, emulated.prediction)}


def test_the_pretrain_workload_learns_its_shape_and_passes_its_options_to_the_job(bench):
    args = bench["emulated_cluster"].parse_args(TINY)
    names = [c.name for c in args.selected]
    assert names[:3] == ["1d_fp32", "1d_dedup_fp32", "1d_dedup_fp8"] and len(names) == 4 and args.selected[3].is_2d
    learned = args.learned_workload
    assert learned.batch_per_rank == 16 and learned.num_negatives == 32 and 1 < learned.tokens_per_example < 20
    (item,) = args.cost_shape.features  # one item table: history, targets and negatives
    assert item.ids_per_example == pytest.approx(2 * learned.tokens_per_example + 2)
    argv = bench["emulated.configs"].WORKLOADS["pretrain"].job_argv(args)
    assert argv[argv.index("--workload") + 1] == "pretrain" and argv[argv.index("--num-negatives") + 1] == "32"
    with pytest.raises(SystemExit):
        bench["emulated_cluster"].parse_args([*TINY, "--mean-length", "3"])  # below the 5 items every user has


def _run(step_s: float, inter: float) -> dict:
    return {"step_time_s": step_s, "bytes_per_step_rank0": {"inter_node": inter}}


def test_each_repeat_is_predicted_on_its_own_and_the_statements_are_counted(bench, capsys):
    args = bench["emulated_cluster"].parse_args(TINY)
    prediction = bench["emulated.prediction"]
    link = prediction.emulated_link_cluster(200, 1, 65000)
    one_d, two_d = args.selected[2], args.selected[3]
    compute = 0.2
    predicted = {c.name: prediction.predict(args.cost_shape, c, link, compute) for c in (one_d, two_d)}
    inter = {name: e.inter_node_bytes / 2 for name, e in predicted.items()}  # rank 0's half of its node's bytes
    runs = {}
    for c, factors in ((one_d, (1.1, 2.0)), (two_d, (0.9, 1.0))):  # repeat 2: 1D twice as slow as modelled
        runs[(c.name, "reference")] = [_run(compute, 0), _run(compute, 0)]
        runs[(c.name, "cluster")] = [_run(predicted[c.name].step_s * f, inter[c.name]) for f in factors]
    out = prediction.print_repeats(args.cost_shape, runs, [one_d, two_d], link)
    assert out["repeats"] == 2
    assert [r["model_within_tolerance"] for r in out["per_repeat"]] == [True, False]
    assert out["held"]["model_within_tolerance"] == 1 and out["held"]["bytes_within_tolerance"] == 2
    measured = [r["measured_ratios"]["two_d_vs_one_d"] for r in out["per_repeat"]]
    expected = [predicted[two_d.name].step_s * b / (predicted[one_d.name].step_s * a) for a, b in ((1.1, 0.9), (2.0, 1.0))]
    assert measured == pytest.approx(expected)
    assert out["held"]["two_d_faster"] == sum(m < 1 for m in measured)
    assert "held in 1 of 2 repeats" in capsys.readouterr().out
