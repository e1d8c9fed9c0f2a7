"""The bad-input catalogue: each wrong config or input gets one clear error that names the culprit.

Each row: a name, a callable that must raise, the exception type, and a pattern the message must
match (it names the argument, feature, table, file or rank at fault, and usually the fix).
Multi-process cases (a rank's bad ids, NaN, a dead rank) are in tests/integration/test_reliability_integration.py.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_recsys import EmbeddingOptimizerConfig, GuardConfig, QCommsConfig, ReplicaSyncConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.checkpoint import UncommittedCheckpointError, load_unsharded
from lightning_recsys.data import CriteoDataModule, MalformedLineError, RecBatch, SyntheticClickLogConfig
from lightning_recsys.data.criteo.tsv import CriteoDataset
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel.input.batch_check import InputValidator, feature_tables
from lightning_recsys.parallel.input.input_guard import CoordinatedBatches
from lightning_recsys.parallel.sharding.sharders import validate_sharding_types
from lightning_recsys.parallel.topology.layout import ParallelTopology
from lightning_recsys.strategies.validation import check_device_support

VALIDATOR = InputValidator(feature_tables(DLRMRanker(table_sizes=[10, 20], num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4])))


# A weighted collection (per-id weights) and an unweighted one feeding from the same batch.
WEIGHTED = InputValidator(feature_tables(torch.nn.ModuleList([
    EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t_w", embedding_dim=4, num_embeddings=10, feature_names=["sparse_0"])], is_weighted=True
    ),
    EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_u", embedding_dim=4, num_embeddings=20, feature_names=["sparse_1"])]),
])))


def _kjt(
    keys=("sparse_0", "sparse_1"), values=(1, 2, 3), lengths=(1, 1, 0, 1), values_dtype=torch.int64, weights=None
) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=list(keys), values=torch.tensor(values, dtype=values_dtype), lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
    )


def _raise_problems(kjt: KeyedJaggedTensor, validator: InputValidator = VALIDATOR) -> None:
    problems = validator.problems(kjt, batch=7)
    if problems:
        raise ValueError("\n".join(problems))


# Keys sparse_0, sparse_1, sparse_0: every feature is there, so only a duplicate check sees it.
_DUPLICATE = {"keys": ("sparse_0", "sparse_1", "sparse_0"), "values": (1, 2, 3, 4), "lengths": (1, 1, 0, 1, 1, 0)}
# The same with an out-of-range id in the second sparse_0 block: indexing by key name raised IndexError.
_DUPLICATE_OUT_OF_RANGE = {**_DUPLICATE, "values": (1, 2, 3, 15)}


def _strategy_on(devices: int, num_nodes: int, **kwargs) -> TwoDRecStrategy:
    strategy = TwoDRecStrategy(parallel_devices=[torch.device("cpu")] * devices, **kwargs)
    strategy.num_nodes = num_nodes
    strategy._topology = ParallelTopology.for_world(
        ranks_per_node=devices, num_nodes=num_nodes, sharding_group_size=strategy.sharding_group_size, layout=strategy.layout
    )
    return strategy


def _check_device(strategy: TwoDRecStrategy) -> None:
    check_device_support(
        "cpu", strategy.process_group_backend, strategy.embedding_optimizer_config, strategy.planning, two_d=not strategy.topology.is_1d
    )


def _read_criteo(tmp: Path, line: str) -> None:
    path = tmp / "day.gz"
    with gzip.open(path, "wt") as f:
        f.write(line + "\n")
    list(CriteoDataset(CriteoDataModule([str(path)], table_sizes=10, global_batch_size=1).config, "train"))


def _table_without_features() -> None:
    # TorchRec names the feature of a table configured without one after the table.
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="orphan", embedding_dim=4, num_embeddings=5, feature_names=[])])
    problems = InputValidator(feature_tables(torch.nn.Sequential(ebc))).problems(_kjt(keys=("sparse_0", "sparse_1")), batch=0)
    raise ValueError("\n".join(problems))


def _uncommitted_checkpoint(tmp: Path) -> None:
    (tmp / "half").mkdir()
    load_unsharded(tmp / "half", DLRMRanker(table_sizes=[5]))



def _directory_of_checkpoints(tmp: Path) -> None:
    from lightning_recsys.checkpoint.directory import CheckpointMeta, commit, prepare_temporary

    for step in (2, 4):
        final = tmp / "checkpoints" / f"step={step}.ckpt"
        meta = CheckpointMeta(step=step, world_size=1, sharding_group_size=1, num_replicas=1, layout="all_to_all_optimized", written_by_ranks=[0])
        commit(prepare_temporary(final), final, meta)
    load_unsharded(tmp / "checkpoints", DLRMRanker(table_sizes=[5]))


def _empty_directory(tmp: Path) -> None:
    (tmp / "empty").mkdir()
    load_unsharded(tmp / "empty", DLRMRanker(table_sizes=[5]))


def _trainer_ckpt_path_of_a_wrong_type(tmp: Path) -> None:
    from lightning_recsys import DCPCheckpointIO

    DCPCheckpointIO().load_checkpoint(3)  # what Trainer.fit/validate/test/predict(ckpt_path=3) hands on

CATALOGUE: list[tuple[str, Callable[[Path], object], type[BaseException], str]] = [
    ("id out of range", lambda t: _raise_problems(_kjt(values=(1, 2, 25))), ValueError,
     r"batch 7: feature 'sparse_1' has id 25 at example 1, but table 't_sparse_1' has 20 rows \(valid ids are 0..19\)"),
    ("negative id", lambda t: _raise_problems(_kjt(values=(-4, 2, 3))), ValueError,
     r"feature 'sparse_0' has id -4 at example 0, but table 't_sparse_0' has 10 rows"),
    ("feature without a table", lambda t: _raise_problems(_kjt(keys=("sparse_0", "sparse_9"))), ValueError,
     r"feature\(s\) \['sparse_9'\] that no table uses"),
    ("table's feature missing from the batch", lambda t: _raise_problems(_kjt(keys=("sparse_0", "sparse_9"))), ValueError,
     r"no values for feature\(s\) \['sparse_1'\]"),
    ("lengths do not sum to the values", lambda t: _raise_problems(_kjt(lengths=(1, 1, 1, 1))), ValueError,
     r"the lengths sum to 4 but there are 3 values"),
    ("float ids", lambda t: _raise_problems(_kjt(values_dtype=torch.float32)), ValueError,
     r"values have dtype torch.float32; use torch.int64"),
    ("table configured without features", lambda t: _table_without_features(), ValueError,
     r"no values for feature\(s\) \['orphan'\] that the model's tables need"),
    ("world not divisible by the group", lambda t: _strategy_on(2, 3, sharding_group_size=4), ValueError,
     r"sharding_group_size=4 must divide the world size 6 \(devices=2 x num_nodes=3\); valid sizes are \[1, 2, 3, 6\]"),
    ("unknown layout", lambda t: TwoDRecStrategy(layout="ring"), ValueError, r"layout='ring' is not one of"),
    ("table_row_wise under 2D", lambda t: validate_sharding_types(["table_row_wise"], "cpu", "sharding_types", two_d=True),
     ValueError, r"'table_row_wise', which is not supported under 2D"),
    ("adam on CPU fused tables", lambda t: _check_device(_strategy_on(1, 1, embedding_optimizer=EmbeddingOptimizerConfig(name="adam"))),
     ValueError, r"name='adam'\) is not supported by FBGEMM's fused CPU kernels"),
    ("weight decay with an optimizer FBGEMM cannot decay", lambda t: EmbeddingOptimizerConfig(name="sgd", weight_decay=0.01),
     ValueError, r"name='sgd', weight_decay=0.01\) is not supported: FBGEMM's fused EXACT_SGD kernel has no weight decay"),
    ("weight decay on CPU fused tables",
     lambda t: _check_device(_strategy_on(1, 1, embedding_optimizer=EmbeddingOptimizerConfig(weight_decay=0.01))),
     ValueError, r"weight_decay=0.01\) would be ignored on CPU.*make every table data_parallel"),
    ("nccl on CPU", lambda t: _check_device(_strategy_on(1, 1, process_group_backend="nccl")), ValueError,
     r"process_group_backend='nccl' needs CUDA devices"),
    ("unknown precision", lambda t: QCommsConfig(forward="fp4"), ValueError, r"QCommsConfig\(forward='fp4'\) is not one of"),
    ("unknown qcomms preset", lambda t: TwoDRecStrategy(qcomms="fp6"), ValueError, r"qcomms='fp6' is not a preset"),
    ("bad validate_inputs", lambda t: GuardConfig(validate_inputs="sometimes"), ValueError, r"validate_inputs=.sometimes.\) is not one of"),
    ("sync interval 0", lambda t: ReplicaSyncConfig(every_n_steps=0), ValueError, r"every_n_steps=0 must be an integer >= 1"),
    ("constraint on an unknown sharding type", lambda t: TableConstraints(sharding_types=["diagonal"]), ValueError,
     r"sharding_types=\[..., 'diagonal', ...\]\): not one of"),
    ("malformed data line", lambda t: _read_criteo(t, "1\t2\tthree"), MalformedLineError, r"day.gz.*line 1"),
    ("batch not divisible by the world", lambda t: SyntheticClickLogConfig(global_batch_size=0), ValueError, r"global_batch_size=0 must be >= 1"),
    ("half-written checkpoint", _uncommitted_checkpoint, UncommittedCheckpointError, r"half"),
    ("a directory of checkpoints instead of one", _directory_of_checkpoints, UncommittedCheckpointError,
     r"checkpoints' is a directory of checkpoints, not one: it holds \['step=2.ckpt', 'step=4.ckpt'\]. Pass one of them, e.g. the newest, '.*step=4.ckpt' \(latest_checkpoint"),
    ("an empty directory as a checkpoint", _empty_directory, UncommittedCheckpointError, r"empty' is an empty directory, not a checkpoint"),
    ("a checkpoint path of a wrong type", lambda t: load_unsharded(7, DLRMRanker(table_sizes=[5])), TypeError,  # type: ignore[arg-type]
     r"path=7 is an int, not a checkpoint path: pass a str or os.PathLike"),
    ("a Trainer ckpt_path of a wrong type", _trainer_ckpt_path_of_a_wrong_type, TypeError,
     r"ckpt_path=3 is an int, not a checkpoint path: pass a str or os.PathLike.*'last'"),
    ("duplicate KJT keys", lambda t: _raise_problems(_kjt(**_DUPLICATE)), ValueError,
     r"batch 7: the KeyedJaggedTensor has duplicate key\(s\): 'sparse_0' at key positions \[0, 2\].*merge the ids into one key"),
    ("duplicate KJT keys with a bad id in the second copy", lambda t: _raise_problems(_kjt(**_DUPLICATE_OUT_OF_RANGE)), ValueError,
     r"duplicate key\(s\): 'sparse_0' at key positions \[0, 2\]"),
    ("weights shorter than the values", lambda t: _raise_problems(_kjt(weights=(1.0, 2.0)), WEIGHTED), ValueError,
     r"batch 7: the KeyedJaggedTensor has 2 weights for 3 ids; give exactly one weight per id"),
    ("non-finite weight", lambda t: _raise_problems(_kjt(values=(1, 2, 3, 4), lengths=(1, 2, 0, 1), weights=(1.0, 1.0, float("inf"), 1.0)), WEIGHTED),
     ValueError, r"feature 'sparse_0' has a non-finite weight at example 1; 1 non-finite weight\(s\).*Weights must be finite"),
    ("NaN weight of the second feature", lambda t: _raise_problems(_kjt(weights=(1.0, 1.0, float("nan"))), WEIGHTED),
     ValueError, r"feature 'sparse_1' has a non-finite weight at example 1"),
    ("weighted table without weights", lambda t: _raise_problems(_kjt(), WEIGHTED), ValueError,
     r"feature\(s\) \['sparse_0'\] feed weighted table\(s\) \['t_w'\] \(EmbeddingBagCollection\(is_weighted=True\)\), "
     r"but the KeyedJaggedTensor has no weights"),
    ("integer weights", lambda t: _raise_problems(_kjt(weights=(1, 2, 3)), WEIGHTED), ValueError,
     r"weights have dtype torch.int64; use a float dtype"),
    ("weights for an unweighted model", lambda t: _raise_problems(_kjt(weights=(1.0, 2.0, 3.0))), ValueError,
     r"carries weights, but no table its features feed is weighted, so they are ignored.*is_weighted=True"),
]


@pytest.mark.parametrize(("name", "action", "error", "pattern"), CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_gets_one_clear_error(name, action, error, pattern, tmp_path):
    with pytest.raises(error, match=pattern):
        action(tmp_path)


def test_the_catalogue_is_at_least_fifteen_cases():
    assert len(CATALOGUE) >= 15


def test_valid_input_has_no_problems():
    assert VALIDATOR.problems(_kjt(), batch=0) == []
    assert WEIGHTED.problems(_kjt(weights=(0.5, 1.0, 2.0)), batch=0) == []


def test_only_clampable_problems_may_be_downgraded_to_a_warning():
    # validate_inputs="warn" goes on after these only; FBGEMM clamps ids, unweighted tables drop weights.
    assert [p.fatal for p in VALIDATOR.check(_kjt(values=(1, 2, 25)), batch=0)] == [False]
    assert [p.fatal for p in VALIDATOR.check(_kjt(weights=(1.0, 2.0, 3.0)), batch=0)] == [False]
    for kjt, validator in ((_kjt(**_DUPLICATE), VALIDATOR), (_kjt(weights=(1.0,)), WEIGHTED), (_kjt(), WEIGHTED)):
        assert all(p.fatal for p in validator.check(kjt, batch=0))


def test_an_exception_inside_the_check_becomes_a_fatal_problem_not_an_exception():
    class Broken(InputValidator):
        def check(self, kjt, *, batch):
            raise IndexError("index 0 is out of bounds")

    batches = CoordinatedBatches([], group=None, validator=Broken({}), validate="warn", equal_sizes_required=False)
    problems, size = batches.check(RecBatch(dense=torch.zeros(2, 1), sparse=_kjt(), labels=torch.zeros(2)), 3)
    assert size == 2 and [p.fatal for p in problems] == [True]
    assert "batch 3: checking the batch raised IndexError: index 0 is out of bounds" in problems[0].message



def test_a_batch_may_carry_one_kjt_per_tower_and_a_feature_is_missing_only_when_none_has_it():
    # A two-tower batch: {"user": KJT(sparse_0), "item": KJT(sparse_1)}. Each KJT was checked against every
    # feature of the model, so this valid batch was refused as fatal ("no values for feature(s) ['sparse_1']").
    batches = CoordinatedBatches([], group=None, validator=WEIGHTED, validate="error", equal_sizes_required=False)
    user = _kjt(keys=("sparse_0",), values=(1, 2), lengths=(1, 1), weights=(1.0, 0.5))
    item = _kjt(keys=("sparse_1",), values=(3,), lengths=(0, 1))
    problems, size = batches.check({"user": user, "item": item, "labels": torch.zeros(2)}, 0)
    assert (problems, size) == ([], 2)
    # The per-KJT checks still run: an id out of range in the second KJT is found.
    problems, _ = batches.check({"user": user, "item": _kjt(keys=("sparse_1",), values=(25,), lengths=(0, 1))}, 0)
    assert [p.fatal for p in problems] == [False] and "'sparse_1' has id 25" in problems[0].message
    # A feature that no KJT holds is still missing, and said once.
    problems, _ = batches.check({"user": user, "other": _kjt(keys=("sparse_0",), values=(1,), lengths=(0, 1), weights=(1.0,))}, 0)
    assert [p.message for p in problems if "no values" in p.message] == [
        "batch 0: the batch has no values for feature(s) ['sparse_1'] that the model's tables need"
    ]
