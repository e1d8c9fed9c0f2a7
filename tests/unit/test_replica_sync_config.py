import pytest

from lightning_recsys import ReplicaSyncConfig, TwoDRecStrategy


def test_defaults():
    config = ReplicaSyncConfig()
    assert (config.rows, config.every_n_steps, config.overlap, config.precision, config.optimizer_state) == ("touched", 1, False, "fp32", True)
    assert config.exchange == "all_reduce" and not config.sends_deltas
    assert config.average == "auto"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": "some"}, r"rows='some' must be one of \['touched', 'all'\]"),
        ({"every_n_steps": 0}, r"every_n_steps=0 must be an integer >= 1"),
        ({"every_n_steps": 2.0}, r"every_n_steps=2.0 must be an integer >= 1"),
        ({"every_n_steps": True}, r"every_n_steps=True must be an integer >= 1"),
        ({"optimizer_state": 1}, r"optimizer_state=1 must be a bool"),
        ({"overlap": "yes"}, r"overlap='yes' must be a bool"),
        ({"precision": "fp4"}, r"precision='fp4' must be one of \['fp32', 'bf16', 'fp8'\]"),
        ({"precision": "fp8"}, r"precision='fp8' needs exchange='all_gather' \(got exchange='all_reduce'\)"),
        ({"exchange": "broadcast"}, r"exchange='broadcast' must be one of \['all_reduce', 'all_gather'\]"),
        ({"exchange": "all_gather", "rows": "all"}, r"exchange='all_gather' needs rows='touched' \(got rows='all'\)"),
        ({"precision": "bf16", "rows": "all"}, r"precision='bf16' needs rows='touched' \(got rows='all'\)"),
        ({"average": "mean"}, r"average='mean' must be one of \['auto', 'all_replicas', 'touching_replicas'\]"),
        ({"average": "touching_replicas", "rows": "all"}, r"average='touching_replicas' needs rows='touched' \(got rows='all'\)"),
    ],
)
def test_invalid_values_are_refused_naming_field_value_and_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicaSyncConfig(**kwargs)


def test_fp8_deltas_go_by_all_gather_and_every_all_gather_sends_deltas():
    config = ReplicaSyncConfig(precision="fp8", exchange="all_gather", overlap=True, every_n_steps=4)
    assert config.sends_deltas
    assert config.describe() == "touched rows, every 4, overlapped, fp8 deltas, all-gather"
    assert ReplicaSyncConfig(exchange="all_gather").sends_deltas


@pytest.mark.parametrize(
    ("average", "rows", "adaptive", "touching"),
    [
        ("auto", "touched", True, True),  # row-wise Adagrad, Adam: a plain average shrinks a row one replica moved
        ("auto", "touched", False, False),  # SGD: the plain average is exactly the 1D update
        ("auto", "all", True, False),  # whole shards carry no record of who touched a row
        ("all_replicas", "touched", True, False),
        ("touching_replicas", "touched", False, True),
    ],
)
def test_average_resolves_by_the_optimizer_and_rows(average, rows, adaptive, touching):
    config = ReplicaSyncConfig(average=average, rows=rows)
    assert config.averages_over_touching_replicas(adaptive) is touching


def test_describe_names_an_explicit_average_only():
    assert "averaged" not in ReplicaSyncConfig().describe()
    assert ReplicaSyncConfig(average="all_replicas").describe() == "touched rows, every 1, averaged over all replicas"


def test_overlap_and_bf16_deltas_are_accepted():
    config = ReplicaSyncConfig(overlap=True, precision="bf16", every_n_steps=4)
    assert (config.overlap, config.precision, config.rows) == (True, "bf16", "touched")
    assert ReplicaSyncConfig(rows="all", overlap=True).overlap


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ReplicaSyncConfig("all")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ReplicaSyncConfig().rows = "all"  # type: ignore[misc]


def test_the_strategy_takes_a_config_and_refuses_anything_else():
    assert TwoDRecStrategy().replica_sync_config == ReplicaSyncConfig()
    config = ReplicaSyncConfig(rows="all", every_n_steps=4)
    assert TwoDRecStrategy(replica_sync=config).replica_sync_config is config
    with pytest.raises(TypeError, match=r"replica_sync=4\): expected a ReplicaSyncConfig"):
        TwoDRecStrategy(replica_sync=4)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TwoDRecStrategy(sync_every_n_steps=2)  # type: ignore[call-arg]
