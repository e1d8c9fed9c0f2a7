import pytest

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel import make_sharders
from lightning_recsys.planner import make_sharding_plan, plan_rows, summarize_plan


def _plan(constraints=None, sharding_types=None):
    model = DLRMRanker(table_sizes=[100, 200, 300], embedding_dim=8, dense_arch_layer_sizes=[8, 8], embedding_device="meta")
    sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params(), sharding_types)
    return make_sharding_plan(
        model, sharders, sharding_group_size=2, group_ranks_per_node=2, compute_device="cpu", constraints=constraints
    )


def test_per_table_constraints_are_honoured():
    plan = _plan(
        constraints={
            "t_sparse_0": TableConstraints(sharding_types=["row_wise"]),
            "t_sparse_1": TableConstraints(sharding_types=["column_wise"]),
            "t_sparse_2": TableConstraints(sharding_types=["data_parallel"]),
        }
    )
    by_table = {row["table"]: row for row in plan_rows(plan)}
    assert by_table["t_sparse_0"]["sharding_type"] == "row_wise" and by_table["t_sparse_0"]["ranks"] == [0, 1]
    assert by_table["t_sparse_1"]["sharding_type"] == "column_wise"
    assert by_table["t_sparse_2"]["sharding_type"] == "data_parallel"
    assert "t_sparse_1" in summarize_plan(plan)


def test_global_allow_list_restricts_every_table():
    plan = _plan(sharding_types=["table_wise"])
    assert {row["sharding_type"] for row in plan_rows(plan)} == {"table_wise"}


def test_constraint_for_unknown_table_is_an_error():
    with pytest.raises(ValueError, match=r"table_constraints names tables that the model does not have: \['nope'\]"):
        _plan(constraints={"nope": TableConstraints(sharding_types=["row_wise"])})
