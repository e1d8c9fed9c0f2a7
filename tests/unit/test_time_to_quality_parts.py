"""benchmarks/time_to_quality.py without root: the config it trains, its overrides, and how it judges the runs
(the job itself: tests/integration/test_time_to_quality_job.py)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import _quality_job
import time_to_quality
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CONFIG = BENCHMARKS.parent / "examples" / "configs" / "synthetic_pretrain.yaml"


@pytest.fixture
def bench() -> dict[str, ModuleType]:
    """The benchmark modules under test by name (benchmarks/ is on pytest's pythonpath, as their siblings expect)."""
    return {m.__name__: m for m in (time_to_quality, _quality_job)}


def test_overrides_reach_the_model_through_the_configs_interpolations(bench):
    config = bench["_quality_job"].load_config(
        CONFIG, ["data.num_items=4096", "model.embedding_dim=64", "data.num_negatives=all", "trainer.strategy.init_args.embedding_optimizer.lr=0.1"]
    )
    assert config["trainer"]["strategy"]["init_args"]["embedding_optimizer"]["lr"] == 0.1
    assert config["data"]["init_args"]["num_items"] == 4096
    data, model = bench["_quality_job"].instantiate_linked(config)
    assert data.num_items == model.hparams.num_items == 4096  # linked from the data, as the CLI does
    assert config["model"]["init_args"]["embedding_dim"] == 64 and config["data"]["init_args"]["num_negatives"] == "all"
    assert config["trainer"]["strategy"]["init_args"]["embedding_optimizer"]["name"] == "rowwise_adagrad"


@pytest.mark.parametrize(
    ("item", "message"),
    [("data.num_itemz=5", "has no data.init_args.num_itemz"), ("trainer.max_epochz=3", "has no trainer.max_epochz"), ("model", "expected KEY=VALUE")],
)
def test_a_bad_override_names_itself_and_the_choices(bench, item, message):
    with pytest.raises(ValueError, match=message) as info:
        bench["_quality_job"].load_config(CONFIG, [item])
    assert repr(item) in str(info.value)


def test_the_benchmark_scales_the_config_and_lets_the_user_override_it(bench):
    args = bench["time_to_quality"].parse_args(["--set", "data.num_users=512"])
    data = args.config["data"]["init_args"]
    assert data["num_items"] == 32768 and data["num_users"] == 512  # the benchmark's size, then the user's --set
    with pytest.raises(SystemExit):
        bench["time_to_quality"].parse_args(["--threshold-fraction", "1.5"])


def test_the_cost_model_ranks_the_default_configurations_for_this_workload(bench):
    ttq = bench["time_to_quality"]
    from emulated.prediction import emulated_link_cluster

    args = ttq.parse_args(["--set", "data.num_users=256", "--set", "data.num_items=1024", "--set", "data.global_batch_size=64"])
    shape = ttq.workload_shape(args)
    configs = ttq.choose_configs(args, shape, emulated_link_cluster(200, 1, 65000))
    assert [c.name for c in configs][:2] == ["1d_fp32", "1d_dedup_fp8"] and configs[2].is_2d
    with pytest.raises(SystemExit, match="sync interval"):
        ttq.choose_configs(ttq.parse_args(["--configs", "1d_fp32,2d_touched_overlap_sync4", "--eval-every", "6"]), shape,
                           emulated_link_cluster(200, 1, 65000))  # fmt: skip


def _run(step: int | None, train_s: float | None) -> dict:
    return {"reached": None if step is None else {"step": step, "train_s": train_s, "wall_s": 2 * train_s},
            "bytes_per_step_rank0": {"total": 3e6, "inter_node": 2e6}}  # fmt: skip


def test_each_repeat_is_judged_against_its_own_1d_fp32_run(bench, capsys):
    ttq = bench["time_to_quality"]
    from emulated.configs import CONFIGS

    configs = [c for c in CONFIGS if c.name in ("1d_fp32", "1d_dedup_fp8", "2d_touched_overlap_sync4")]
    runs = {
        "1d_fp32": [_run(96, 24.0), _run(96, 30.0), _run(112, 20.0)],
        "1d_dedup_fp8": [_run(96, 21.0), _run(96, 27.0), _run(None, None)],  # repeat 3 never got there
        "2d_touched_overlap_sync4": [_run(96, 18.0), _run(112, 26.0), _run(112, 19.0)],
    }
    summary = ttq.summarize(runs, configs, threshold=0.6)
    assert [r["fastest"] for r in summary["per_repeat"]] == ["2d_touched_overlap_sync4", "2d_touched_overlap_sync4", "2d_touched_overlap_sync4"]
    assert [round(r["speedup"], 3) for r in summary["per_repeat"]] == [round(24 / 18, 3), round(30 / 26, 3), round(20 / 19, 3)]
    assert summary["target_held"] == 1  # only repeat 1 is >= 1.2x
    rows = summary["configs"]
    assert rows["1d_dedup_fp8"]["median_train_s"] is None and rows["1d_dedup_fp8"]["steps"] == [96, 96, None]
    assert rows["2d_touched_overlap_sync4"]["speedup_vs_1d_fp32"] == pytest.approx(24.0 / 19.0)
    assert summary["by_wall_s"]["target_held"] == 1
    assert "held in 1 of 3 repeats" in capsys.readouterr().out


def test_the_header_says_which_replicas_the_2d_runs_average_a_row_over(bench):
    ttq = bench["time_to_quality"]
    from emulated.configs import CONFIGS

    chosen = [c for c in CONFIGS if c.name in ("1d_fp32", "2d_gather_overlap_fp8_sync4")]
    line = ttq._replica_average_line(ttq.parse_args([]), chosen)
    assert line == (
        "Embedding optimizer rowwise_adagrad, lr 0.05; replica average 'auto' "
        "(2d_gather_overlap_fp8_sync4: each row over the replicas that touched it)."
    )
    plain = ttq._replica_average_line(ttq.parse_args(["--replica-average", "all_replicas", "--set", "trainer.strategy.init_args.embedding_optimizer.name=sgd"]), chosen)
    assert plain.startswith("Embedding optimizer sgd, lr 0.05; replica average 'all_replicas'") and "over all replicas" in plain
    assert ttq._replica_average_line(ttq.parse_args([]), chosen[:1]).endswith("(no 2D configuration).")
