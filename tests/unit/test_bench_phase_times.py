"""benchmarks/_bench_job.py's phase timer: per-step phases grouped by the step's position in the sync interval."""

import _bench_job as bench_job  # benchmarks/_bench_job.py


def test_phases_are_averaged_per_position_in_the_sync_interval_over_the_timed_steps_only():
    timer = bench_job._PhaseTimer.__new__(bench_job._PhaseTimer)  # without wrapping the product's methods
    # 2 warm-up steps, then 6 timed steps of an interval of 3: the last position syncs, the middle one is slow.
    timer.steps = [{"forward": 9.0, "backward": 9.0}] * 2 + [
        {"forward": 0.010, "backward": 0.020 + 0.010 * (i % 3 == 1), "sync_total": 0.005 if i % 3 == 2 else 0.0} for i in range(6)
    ]
    by_position = timer.by_step_in_interval(2, 6, 3)
    assert [round(p["backward"], 6) for p in by_position] == [20.0, 30.0, 20.0]
    assert [round(p["sync_total"], 6) for p in by_position] == [0.0, 0.0, 5.0]
    assert all(round(p["forward"], 6) == 10.0 for p in by_position)
