"""The package faces: every subpackage of ``parallel/`` (and ``planner/cost/``) exports what it lists, and the
names ``lightning_recsys.parallel`` and ``lightning_recsys`` exported before the subpackages still import."""

from __future__ import annotations

import importlib

import pytest

import lightning_recsys

FACES = [
    "lightning_recsys.parallel.topology",
    "lightning_recsys.parallel.comms",
    "lightning_recsys.parallel.input",
    "lightning_recsys.parallel.sync",
    "lightning_recsys.parallel.sharding",
    "lightning_recsys.planner.cost",
]
# What ``lightning_recsys.parallel`` exported when it was one flat folder; kept for users' imports.
PARALLEL_NAMES = [
    "ALL_SHARDING_TYPES", "EmbeddingOptimizerConfig", "ParallelTopology", "ReshapedEmbeddingBagCollection", "ShardedModel",
    "apply_reshape", "make_sharders", "plan_rows", "shard_model", "summarize_plan", "supported_sharding_types",
]  # fmt: skip


@pytest.mark.parametrize("face", FACES)
def test_every_listed_name_of_a_face_imports(face):
    module = importlib.import_module(face)
    assert module.__all__, f"{face} lists nothing"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{face}.__all__ lists names it does not have: {missing}"


def test_lightning_recsys_parallel_keeps_its_names():
    parallel = importlib.import_module("lightning_recsys.parallel")
    assert sorted(parallel.__all__) == sorted(PARALLEL_NAMES)
    for name in PARALLEL_NAMES:
        assert getattr(parallel, name) is not None


@pytest.mark.parametrize("name", sorted(lightning_recsys._EXPORTS))
def test_every_lazy_export_of_the_package_resolves(name):
    value = getattr(lightning_recsys, name)
    assert value.__name__ == name


def test_the_topology_module_path_still_gives_parallel_topology():
    # `lightning_recsys.parallel.topology` was a module; it is now the topology face with the same names.
    from lightning_recsys.parallel.topology import LAYOUTS, ParallelTopology

    assert ParallelTopology.__module__ == "lightning_recsys.parallel.topology.layout" and "all_to_all_optimized" in LAYOUTS
