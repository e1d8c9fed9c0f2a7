"""TwoDRecStrategy without a process group: registration and Trainer-level checks."""

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry

import lightning_recsys  # noqa: F401 - registers "twod_rec"
from lightning_recsys import DCPCheckpointIO, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.parallel.sharding.sharders import supported_sharding_types, validate_sharding_types
from lightning_recsys.parallel.topology.layout import ParallelTopology
from lightning_recsys.planner import PlanningConfig
from lightning_recsys.strategies.validation import check_device_support, check_trainer_settings


def test_registered_by_name_with_description():
    assert "twod_rec" in StrategyRegistry
    assert "TorchRec" in StrategyRegistry["twod_rec"]["description"]


def test_trainer_resolves_the_name():
    trainer = Trainer(strategy="twod_rec", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, TwoDRecStrategy)
    assert trainer.strategy.num_processes == 2
    # Without this, Lightning silently ignores self.log(..., sync_dist=True) under the strategy.
    assert trainer._accelerator_connector.is_distributed


def test_cpu_exposes_row_wise_types():
    assert set(supported_sharding_types("cpu")) == {
        "data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise",
    }


def test_sharding_type_unknown_on_device_is_rejected():
    with pytest.raises(ValueError, match=r"'grid_shard', which is not one of"):
        validate_sharding_types(["grid_shard"], "cpu", "sharding_types")


def _fake_trainer(**overrides):
    return SimpleNamespace(**{"accumulate_grad_batches": 1, "callbacks": [], **overrides})


def test_gradient_accumulation_is_refused():
    strategy = TwoDRecStrategy()
    strategy.precision_plugin = Precision()
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4\) is not supported"):
        check_trainer_settings(_fake_trainer(accumulate_grad_batches=4), strategy.precision_plugin, strategy.checkpoint_io)


def test_a_gradient_accumulation_schedule_is_refused():
    # It raised the accumulation only at epoch 1's start, after setup's check: the dense layers then
    # accumulated over 2 batches while FBGEMM went on updating the tables every batch.
    strategy = TwoDRecStrategy()
    strategy.precision_plugin = Precision()
    scheduled = _fake_trainer(callbacks=[GradientAccumulationScheduler(scheduling={0: 1, 1: 2})])
    with pytest.raises(ValueError, match=r"GradientAccumulationScheduler\(scheduling=\{0: 1, 1: 2\}\) is not supported"):
        check_trainer_settings(scheduled, strategy.precision_plugin, strategy.checkpoint_io)
    ones = _fake_trainer(callbacks=[GradientAccumulationScheduler(scheduling={0: 1})])
    check_trainer_settings(ones, strategy.precision_plugin, strategy.checkpoint_io)  # accumulates nothing: fine


def test_checkpoints_go_through_dcp_on_every_rank():
    strategy = TwoDRecStrategy()
    strategy.precision_plugin = Precision()
    assert isinstance(strategy.checkpoint_io, DCPCheckpointIO) and strategy.restore_checkpoint_after_setup
    check_trainer_settings(_fake_trainer(callbacks=[ModelCheckpoint()]), strategy.precision_plugin, strategy.checkpoint_io)  # ModelCheckpoint is welcome
    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.raises(ValueError, match=r"needs checkpoint_io=DCPCheckpointIO \(the default\); got TorchCheckpointIO"):
        check_trainer_settings(_fake_trainer(), strategy.precision_plugin, strategy.checkpoint_io)
    with pytest.raises(RuntimeError, match=r"before TwoDRecStrategy has sharded the model"):
        DCPCheckpointIO().save_checkpoint({}, "x.ckpt")


def test_nccl_on_cpu_is_refused_before_any_process_group():
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs CUDA devices"):
        check_device_support("cpu", "nccl", lightning_recsys.EmbeddingOptimizerConfig(), PlanningConfig(), two_d=False)


def test_adam_on_cpu_is_refused_before_any_process_group():
    adam = lightning_recsys.EmbeddingOptimizerConfig(name="adam")
    with pytest.raises(ValueError, match=r"name='adam'\) is not supported by FBGEMM's fused CPU kernels"):
        check_device_support("cpu", None, adam, PlanningConfig(), two_d=False)


def _topology(strategy: TwoDRecStrategy) -> ParallelTopology:
    return ParallelTopology.for_world(
        ranks_per_node=strategy.num_processes, num_nodes=strategy.num_nodes,
        sharding_group_size=strategy.sharding_group_size, layout=strategy.layout,
    )


def _strategy_on(devices: int, num_nodes: int, **kwargs) -> TwoDRecStrategy:
    strategy = TwoDRecStrategy(parallel_devices=[torch.device("cpu")] * devices, **kwargs)
    strategy.num_nodes = num_nodes
    return strategy


def test_sharding_group_size_defaults_to_the_devices_per_node():
    topology = _topology(_strategy_on(2, 3))
    assert (topology.world_size, topology.sharding_group_size, topology.node_size) == (6, 2, 2)
    assert topology.sharding_groups() == [[0, 1], [2, 3], [4, 5]]
    assert _topology(_strategy_on(4, 1)).is_1d


def test_sharding_group_size_that_does_not_divide_the_world_is_refused_before_any_process_group():
    strategy = _strategy_on(2, 2, sharding_group_size=3)
    with pytest.raises(ValueError, match=r"sharding_group_size=3 must divide the world size 4 \(devices=2 x num_nodes=2\); valid sizes are \[1, 2, 4\]"):
        _topology(strategy)
    with pytest.raises(ValueError, match=r"sharding_group_size=8 must divide the world size 4"):
        _topology(_strategy_on(2, 2, sharding_group_size=8))


def test_table_row_wise_is_refused_under_2d_only():
    validate_sharding_types(["table_row_wise"], "cpu", "sharding_types", two_d=False)
    with pytest.raises(ValueError, match=r"'table_row_wise', which is not supported under 2D parallelism .* Use 'row_wise'"):
        validate_sharding_types(["table_row_wise"], "cpu", "sharding_types", two_d=True)
    assert "table_row_wise" not in supported_sharding_types("cpu", two_d=True)


def test_trainer_accepts_the_2d_arguments():
    strategy = TwoDRecStrategy(sharding_group_size=2, layout="all_reduce_optimized", replica_sync=ReplicaSyncConfig(every_n_steps=4))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, logger=False)
    assert trainer.strategy is strategy and strategy.num_nodes == 2
    with pytest.raises(RuntimeError, match=r"topology is available only after"):
        strategy.topology


@pytest.mark.parametrize(
    ("devices", "num_nodes", "env", "expected"),
    [
        # torchrun --nproc-per-node 2, Trainer(devices=1, num_nodes=2): rank 1 indexed past the devices (IndexError).
        (1, 2, {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"}, "Set devices=2 and num_nodes=1"),
        # torchrun 2 nodes x 2, Trainer(devices=4, num_nodes=1): silently 1D across both nodes.
        (4, 1, {"RANK": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"}, "Set devices=2 and num_nodes=2"),
    ],
    ids=["devices-1-of-2-per-node", "devices-4-on-2x2"],
)
def test_devices_that_disagree_with_torchruns_processes_per_node_are_refused_before_any_process_group(
    monkeypatch, devices, num_nodes, env, expected
):
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning_recsys.testing.processes import free_port

    world = devices * num_nodes
    for name, value in {
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), **env,
    }.items():
        monkeypatch.setenv(name, value)
    strategy = TwoDRecStrategy(
        accelerator=CPUAccelerator(), parallel_devices=[torch.device("cpu")] * devices,
        cluster_environment=TorchElasticEnvironment(), process_group_timeout=3,
    )
    strategy.num_nodes = num_nodes
    with pytest.raises(ValueError, match=rf"Trainer\(devices={devices}, num_nodes={num_nodes}\) does not match the launch: "
                       rf"torchrun started 2 processes per node \(LOCAL_WORLD_SIZE=2\) of {world} in all.*{expected}"):
        strategy.setup_environment()
    assert not dist.is_initialized()
