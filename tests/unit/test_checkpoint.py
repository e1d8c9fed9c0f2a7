"""The checkpoint layer without a process group: layout and commit, resharding rules, validation, export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from lightning_recsys.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    UncommittedCheckpointError,
    is_committed,
    latest_checkpoint,
    load_checkpoint,
    load_unsharded,
    read_meta,
    save_checkpoint,
    to_lightning_checkpoint,
)
from lightning_recsys.checkpoint.directory import (
    MARKER_FILE,
    CheckpointMeta,
    commit,
    prepare_temporary,
    software_versions,
    temporary_path,
)
from lightning_recsys.checkpoint.table_state import (
    ROWWISE_MOMENTUM,
    EmbeddingOptimizerState,
    TablePlacement,
    columns_to_rowwise,
    rowwise_to_columns,
    state_key,
)
from lightning_recsys.checkpoint.validation import ExpectedEntry, check_entries


# ----------------------------------------------------------------- helpers
def _meta(step: int | None = 3, saved_at: str = "2026-11-01T00:00:00+00:00") -> CheckpointMeta:
    return CheckpointMeta(
        step=step, world_size=2, sharding_group_size=2, num_replicas=1, layout="all_to_all_optimized",
        written_by_ranks=[0, 1], saved_at=saved_at,
    )


def _commit_empty(directory: Path, name: str, **meta_kwargs: object) -> Path:
    final = directory / name
    tmp = prepare_temporary(final)
    commit(tmp, final, _meta(**meta_kwargs))  # type: ignore[arg-type]
    return final


def _metadata(shapes: dict[str, tuple[int, ...]]) -> Metadata:
    return Metadata(
        state_dict_metadata={
            key: TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape), chunks=[])
            for key, shape in shapes.items()
        }
    )


class Ranker(nn.Module):
    def __init__(self, tables: tuple[tuple[str, int], ...] = (("t0", 5), ("t1", 7))) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r in tables]
        )
        self.over = nn.Linear(4 * len(tables), 1)


def _save_unsharded(module: nn.Module, final: Path, host_state: dict | None = None) -> Path:
    """A committed checkpoint of an unsharded module, in the layout save_checkpoint writes."""
    tmp = prepare_temporary(final)
    dcp.save({f"model.{k}": v for k, v in module.state_dict().items()}, checkpoint_id=tmp, no_dist=True)
    if host_state is not None:
        torch.save(host_state, tmp / "host_state.pt")
    commit(tmp, final, _meta())
    return final


# ----------------------------------------------------------------- layout and commit
def test_commit_writes_marker_and_meta_last_and_replaces_an_existing_checkpoint(tmp_path: Path) -> None:
    final = _commit_empty(tmp_path, "ckpt", step=1)
    assert is_committed(final) and not temporary_path(final).exists()
    assert json.loads((final / "meta.json").read_text())["step"] == 1
    (final / "old_file").touch()
    _commit_empty(tmp_path, "ckpt", step=2)
    assert read_meta(final).step == 2 and not (final / "old_file").exists()
    # The name is a symlink to its one data directory; no temporary or replaced directory is left behind.
    assert final.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", os.readlink(final)])
    assert os.readlink(final).startswith(".ckpt-")


def test_prepare_removes_a_stale_partial_save_but_finishes_an_interrupted_commit(tmp_path: Path) -> None:
    stale = temporary_path(tmp_path / "a")
    stale.mkdir()
    (stale / "__0_0.distcp").touch()
    assert not is_committed(stale)
    assert list(prepare_temporary(tmp_path / "a").iterdir()) == []

    # Crash between the two renames: the new, committed copy sits at the temporary name and b is gone.
    interrupted = temporary_path(tmp_path / "b")
    interrupted.mkdir()
    (interrupted / "meta.json").write_text(_meta(step=7).to_json())  # as commit() writes them, before renaming
    (interrupted / MARKER_FILE).write_text("{}")
    assert latest_checkpoint(tmp_path) == interrupted  # complete, so it is a checkpoint
    prepare_temporary(tmp_path / "b")
    assert read_meta(tmp_path / "b").step == 7


def test_save_refuses_to_replace_something_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.csv").touch()
    (tmp_path / "file.ckpt").touch()
    for name in ("data", "file.ckpt"):
        with pytest.raises(ValueError, match=f"cannot save a checkpoint to .*{name}.*not a committed checkpoint"):
            prepare_temporary(tmp_path / name)
    assert (tmp_path / "data" / "precious.csv").exists()
    (tmp_path / "empty").mkdir()
    prepare_temporary(tmp_path / "empty")  # an empty directory may be replaced


def test_latest_checkpoint_orders_by_step_then_time_and_skips_uncommitted(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    _commit_empty(tmp_path, "no_step", step=None)
    assert latest_checkpoint(tmp_path) == tmp_path / "no_step"
    _commit_empty(tmp_path, "step_10", step=10)
    _commit_empty(tmp_path, "step_9_later", step=9, saved_at="2030-01-01T00:00:00+00:00")
    _commit_empty(tmp_path, "step_10_later", step=10, saved_at="2026-12-01T00:00:00+00:00")
    partial = tmp_path / "step_99"
    partial.mkdir()
    (partial / "meta.json").write_text(_meta(step=99).to_json())  # meta but no marker: a save that died
    (tmp_path / "a_file").touch()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10_later"


def test_read_meta_refuses_missing_uncommitted_and_newer_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(UncommittedCheckpointError, match="does not exist"):
        read_meta(tmp_path / "nope")
    (tmp_path / "partial").mkdir()
    with pytest.raises(UncommittedCheckpointError, match="no COMMITTED marker.*latest_checkpoint"):
        read_meta(tmp_path / "partial")
    newer = _commit_empty(tmp_path, "newer")
    data = json.loads((newer / "meta.json").read_text())
    (newer / "meta.json").write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(UncommittedCheckpointError, match="format_version=99.*Upgrade"):
        read_meta(newer)
    assert issubclass(UncommittedCheckpointError, ValueError)


def test_software_versions_name_every_package() -> None:
    versions = software_versions()
    assert set(versions) == {"torch", "torchrec", "fbgemm_gpu", "lightning_recsys"}
    assert versions["torch"] == torch.__version__ and versions["fbgemm_gpu"] is not None


# ----------------------------------------------------------------- resharding rules
def test_rowwise_state_spread_over_columns_comes_back_exactly() -> None:
    accumulator = torch.tensor([1 / 3, 0.1, 1e-30, 7.0, 2.0**-20])
    for columns in (1, 2, 3, 5, 7, 8):
        assert torch.equal(columns_to_rowwise(rowwise_to_columns(accumulator, columns)), accumulator)


def test_column_shards_collapse_to_their_column_weighted_mean() -> None:
    # Shards of 2 and 6 columns: the whole row is 2/8 of the first accumulator plus 6/8 of the second.
    by_column = torch.cat([rowwise_to_columns(torch.tensor([4.0]), 2), rowwise_to_columns(torch.tensor([8.0]), 6)], dim=1)
    assert torch.equal(columns_to_rowwise(by_column), torch.tensor([7.0]))


def _shard(offsets: list[int], sizes: list[int], rank: int) -> ShardMetadata:
    return ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}/cpu")


def test_table_placements_map_torchrec_rowwise_state_offsets_to_weight_shards() -> None:
    rows, dim = 7, 8
    row_wise = TablePlacement(key="ebc.embedding_bags.t.weight", rows=rows, dim=dim,
                           shards=(_shard([0, 0], [4, dim], 0), _shard([4, 0], [3, dim], 1)))
    assert row_wise.kind == "row_blocks"
    assert row_wise.weight_shard_of_rowwise_state(4).placement.rank() == 1
    # Column shards listed out of column order: TorchRec stacks their state by column offset.
    column_wise = TablePlacement(key="ebc.embedding_bags.t.weight", rows=rows, dim=dim,
                              shards=(_shard([0, 4], [rows, 4], 0), _shard([0, 0], [rows, 4], 2)))
    assert column_wise.kind == "column_blocks"
    assert column_wise.weight_shard_of_rowwise_state(0).shard_offsets == [0, 0]
    assert column_wise.weight_shard_of_rowwise_state(rows).shard_offsets == [0, 4]
    assert [s.shard_offsets for s in column_wise.local_shards(2)] == [[0, 0]]
    assert TablePlacement.of("k", torch.zeros(rows, dim)).kind == "replicated"
    grid = TablePlacement(key="ebc.embedding_bags.g.weight", rows=rows, dim=dim,
                       shards=(_shard([0, 0], [4, 4], 0), _shard([4, 0], [3, 4], 1), _shard([0, 4], [rows, 4], 2)))
    with pytest.raises(NotImplementedError, match="table 'g'.*grid"):
        grid.check_supported()


def _data_parallel_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], name: str) -> EmbeddingOptimizerState:
    return EmbeddingOptimizerState(
        optimizer_name=name,
        tables={k: TablePlacement.of(k, p.detach()) for k, p in params.items()},
        fused_state={},
        data_parallel_optimizer=optimizer,
        data_parallel_params=params,
        process_group=None,
    )


def _emulate_dcp(saved: dict[str, torch.Tensor], state: EmbeddingOptimizerState, default_step: float = 0.0) -> None:
    """What dcp.load does for replicated tensors: copy each saved tensor into its read target."""
    reads = state.plan_reads({k: (tuple(v.shape), v.dtype) for k, v in saved.items()}, default_step=default_step)
    for key, target in reads.targets.items():
        target.copy_(saved[key])
    reads.apply()


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adagrad", "adam"])
def test_data_parallel_optimizer_state_round_trips_with_its_step(name: str) -> None:
    from lightning_recsys.parallel import EmbeddingOptimizerConfig

    config = EmbeddingOptimizerConfig(name=name, lr=0.1)
    torch.manual_seed(0)
    params = {"ebc.embedding_bags.t.weight": nn.Parameter(torch.randn(5, 4))}
    optimizer = config.make_torch_optimizer(list(params.values()))
    for _ in range(3):
        params["ebc.embedding_bags.t.weight"].grad = torch.randn(5, 4)
        optimizer.step()
    saved = {k: v.clone() for k, v in _data_parallel_state(optimizer, params, name).state_dict_for_save().items()}
    assert saved[state_key("ebc.embedding_bags.t.weight", "step")] == 3
    if name == "rowwise_adagrad":
        assert saved[state_key("ebc.embedding_bags.t.weight", ROWWISE_MOMENTUM)].shape == (5,)

    fresh_params = {"ebc.embedding_bags.t.weight": nn.Parameter(torch.zeros(5, 4))}
    fresh = config.make_torch_optimizer(list(fresh_params.values()))
    _emulate_dcp(saved, _data_parallel_state(fresh, fresh_params, name))
    (original,) = optimizer.state.values()
    (loaded,) = fresh.state.values()
    assert original.keys() == loaded.keys()
    for key in original:
        assert torch.equal(torch.as_tensor(original[key]), torch.as_tensor(loaded[key])), key


def test_data_parallel_table_takes_the_checkpoint_step_and_the_mean_of_column_shards() -> None:
    params = {"ebc.embedding_bags.t.weight": nn.Parameter(torch.zeros(2, 4))}
    optimizer = RowWiseAdagrad(list(params.values()), lr=0.1)
    by_column = torch.tensor([[1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])  # saved from two column shards
    _emulate_dcp({state_key("ebc.embedding_bags.t.weight", ROWWISE_MOMENTUM): by_column},
                 _data_parallel_state(optimizer, params, "rowwise_adagrad"), default_step=42)
    (state,) = optimizer.state.values()
    assert torch.equal(state["sum"], torch.tensor([[2.0], [2.0]])) and state["step"] == 42


def test_a_table_skipped_by_a_non_strict_load_keeps_its_optimizer_state() -> None:
    params = {"ebc.embedding_bags.t.weight": nn.Parameter(torch.zeros(2, 4))}
    optimizer = RowWiseAdagrad(list(params.values()), lr=0.1)
    before = {k: v.clone() for k, v in next(iter(optimizer.state.values())).items()}
    _emulate_dcp({}, _data_parallel_state(optimizer, params, "rowwise_adagrad"), default_step=42)
    after = next(iter(optimizer.state.values()))
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_unknown_optimizer_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'lamb' has no checkpoint mapping"):
        EmbeddingOptimizerState(optimizer_name="lamb", tables={}, fused_state={}, data_parallel_optimizer=None,
                                data_parallel_params={}, process_group=None)


# ----------------------------------------------------------------- validation
def _entries() -> list[ExpectedEntry]:
    return [
        ExpectedEntry(key="model.ebc.embedding_bags.t0.weight", shapes=((5, 4),), table="ebc.embedding_bags.t0.weight"),
        ExpectedEntry(key="model.ebc.embedding_bags.t1.weight", shapes=((9, 4),), table="ebc.embedding_bags.t1.weight"),
        ExpectedEntry(key="model.over.weight", shapes=((1, 8),)),
        ExpectedEntry(key=state_key("ebc.embedding_bags.t0.weight", ROWWISE_MOMENTUM), shapes=((5,), (5, 4)),
                      table="ebc.embedding_bags.t0.weight"),
        ExpectedEntry(key=state_key("ebc.embedding_bags.t1.weight", ROWWISE_MOMENTUM), shapes=((9,), (9, 4)),
                      table="ebc.embedding_bags.t1.weight"),
    ]


def _check(saved: dict[str, tuple[int, ...]], strict: bool = True) -> list[ExpectedEntry]:
    return check_entries(_entries(), _metadata(saved), path=Path("/ckpt"), strict=strict,
                         optimizer_name="rowwise_adagrad", saved_optimizer={"name": "adagrad"})


GOOD = {
    "model.ebc.embedding_bags.t0.weight": (5, 4),
    "model.ebc.embedding_bags.t1.weight": (9, 4),
    "model.over.weight": (1, 8),
    state_key("ebc.embedding_bags.t0.weight", ROWWISE_MOMENTUM): (5,),
    state_key("ebc.embedding_bags.t1.weight", ROWWISE_MOMENTUM): (9, 4),
}


def test_a_matching_checkpoint_loads_every_entry() -> None:
    assert [e.key for e in _check(GOOD)] == [e.key for e in _entries()]


def test_a_resized_table_names_the_table_and_both_shapes_once() -> None:
    saved = {**GOOD, "model.ebc.embedding_bags.t1.weight": (8, 4), state_key("ebc.embedding_bags.t1.weight", ROWWISE_MOMENTUM): (8,)}
    with pytest.raises(CheckpointMismatchError) as info:
        _check(saved, strict=False)  # a resized table fails even when not strict
    message = str(info.value)
    assert "(1 problem)" in message
    assert "table 't1' ('model.ebc.embedding_bags.t1.weight'): the checkpoint has shape (8, 4), the model expects (9, 4)" in message
    assert "How to fix" in message


def test_a_renamed_table_is_reported_with_the_name_it_has_in_the_checkpoint() -> None:
    saved = {("model.ebc.embedding_bags.t0_old.weight" if k == "model.ebc.embedding_bags.t0.weight" else k): v for k, v in GOOD.items()}
    with pytest.raises(CheckpointMismatchError) as info:
        _check(saved)
    message = str(info.value)
    assert "table 't0' ('model.ebc.embedding_bags.t0.weight') (expected shape (5, 4)) is not in the checkpoint" in message
    assert "'model.ebc.embedding_bags.t0_old.weight' with that shape instead: was it renamed?" in message
    assert "'model.ebc.embedding_bags.t0_old.weight' (shape (5, 4)) is in the checkpoint but not in the model" in message
    assert "embedding optimizer state of table 't0'" not in message  # one problem per table


def test_strict_false_skips_keys_on_one_side_only() -> None:
    saved = {k: v for k, v in GOOD.items() if "t1" not in k} | {"model.extra.weight": (3,)}
    keys = [e.key for e in _check(saved, strict=False)]
    assert not any("t1" in k for k in keys) and "model.over.weight" in keys
    with pytest.raises(CheckpointMismatchError, match="'model.extra.weight' \\(shape \\(3,\\)\\) is in the checkpoint but not"):
        _check(saved)


def test_a_checkpoint_from_another_embedding_optimizer_says_which_and_how_to_fix() -> None:
    saved = {k: v for k, v in GOOD.items() if "embedding_optimizer" not in k}
    saved |= {state_key("ebc.embedding_bags.t0.weight", "momentum1"): (5, 4), state_key("ebc.embedding_bags.t1.weight", "momentum1"): (9, 4)}
    with pytest.raises(CheckpointMismatchError) as info:
        _check(saved)
    message = str(info.value)
    assert "it holds ['momentum1'] for this table (saved with embedding optimizer 'adagrad')" in message
    assert "needs 'rowwise_momentum1'" in message and "load_embedding_optimizer_state=False" in message


# ----------------------------------------------------------------- export and entry points
def test_load_unsharded_reads_every_table_and_the_host_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Ranker()
    path = _save_unsharded(source, tmp_path / "ckpt", host_state={"global_step": 4})
    torch.manual_seed(1)
    target = Ranker()
    loaded = load_unsharded(path, target, weights_only=True)
    assert loaded.host_state == {"global_step": 4} and loaded.meta.step == 3
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_load_unsharded_refuses_mismatches_uncommitted_dirs_and_meta_tensors(tmp_path: Path) -> None:
    path = _save_unsharded(Ranker(), tmp_path / "ckpt")
    with pytest.raises(CheckpointMismatchError, match="table 't1'.*shape \\(7, 4\\), the model expects \\(8, 4\\)"):
        load_unsharded(path, Ranker(tables=(("t0", 5), ("t1", 8))))
    partial = temporary_path(tmp_path / "other")
    partial.mkdir()
    with pytest.raises(UncommittedCheckpointError):
        load_unsharded(partial, Ranker())
    with torch.device("meta"):
        on_meta = Ranker()
    with pytest.raises(ValueError, match="meta device"):
        load_unsharded(path, on_meta)


class _WithExtraState(Ranker):
    def get_extra_state(self) -> dict:
        return {"vocab_version": 7}

    def set_extra_state(self, state: dict) -> None:
        self.restored_extra = state


def test_to_lightning_checkpoint_is_the_host_state_plus_the_whole_model_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = _WithExtraState()
    path = _save_unsharded(source, tmp_path / "ckpt", host_state={"global_step": 4, "hyper_parameters": {"x": 1}})
    checkpoint = to_lightning_checkpoint(path, weights_only=True)
    assert checkpoint["global_step"] == 4 and checkpoint["hyper_parameters"] == {"x": 1}
    assert sorted(checkpoint["state_dict"]) == sorted(source.state_dict())  # no "model." prefix, no optimizer state
    target = _WithExtraState()
    target.load_state_dict(checkpoint["state_dict"])  # strict: every key, the extra state rebuilt from DCP's flat keys
    assert target.restored_extra == {"vocab_version": 7}
    for key, value in source.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target.state_dict()[key], value), key


def test_collective_entry_points_say_they_need_a_process_group(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="save_checkpoint\\(\\) is collective.*load_unsharded"):
        save_checkpoint(tmp_path / "x", state=None, topology=None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="load_checkpoint\\(\\) is collective"):
        load_checkpoint(tmp_path / "x", state=None, topology=None)  # type: ignore[arg-type]
    assert not os.listdir(tmp_path)


def test_partial_saves_are_invisible_to_a_search_by_name(tmp_path: Path) -> None:
    # Lightning's ckpt_path="last" takes any entry whose name contains "last".
    assert "last" not in temporary_path(tmp_path / "last.ckpt").name
    final = _commit_empty(tmp_path, "last.ckpt", step=1)
    prepare_temporary(final)  # a new save of "last" has started
    assert [p.name for p in tmp_path.iterdir() if "last" in p.name] == ["last.ckpt"]


# ----------------------------------------------------------------- damaged checkpoints
@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: None, "meta.json is not a JSON object"),
        (lambda m: {k: v for k, v in m.items() if k != "world_size"}, "meta.json lacks 'world_size'"),
        (lambda m: {**m, "step": "three"}, "meta.json has step='three'"),
        (lambda m: {**m, "format_version": "1"}, "format_version='1'.*damaged"),
    ],
)
def test_a_hand_edited_meta_json_is_named_as_damaged_and_skipped_by_the_search(tmp_path: Path, edit, expected) -> None:
    good = _commit_empty(tmp_path, "good", step=1)
    edited = _commit_empty(tmp_path, "edited", step=5)
    (edited / "meta.json").write_text(json.dumps(edit(json.loads((edited / "meta.json").read_text()))))
    with pytest.raises(UncommittedCheckpointError, match=expected):
        read_meta(edited)
    assert latest_checkpoint(tmp_path) == good  # not a TypeError from comparing it


def test_damaged_index_or_host_state_is_named_before_the_model_is_touched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = _save_unsharded(Ranker(), tmp_path / "ckpt", host_state={"global_step": 4})
    data = path.resolve()
    target = Ranker()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    (data / "host_state.pt").write_bytes((data / "host_state.pt").read_bytes()[:10])
    with pytest.raises(UncommittedCheckpointError, match="host_state.pt: the file cannot be read.*damaged.*nothing was loaded"):
        load_unsharded(path, target)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    (data / ".metadata").write_bytes((data / ".metadata").read_bytes()[:20])
    with pytest.raises(UncommittedCheckpointError, match=r"\.metadata: the index cannot be read.*damaged"):
        load_unsharded(path, target)


def test_a_deleted_shard_file_names_the_checkpoint_and_the_file(tmp_path: Path) -> None:
    path = _save_unsharded(Ranker(), tmp_path / "ckpt")
    shard = next(path.resolve().glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match=f"{shard.name}: the shard file the index names is missing.*damaged"):
        load_unsharded(path, Ranker())


def test_a_plain_lightning_checkpoint_file_is_named_as_such(tmp_path: Path) -> None:
    torch.save({"state_dict": {}, "global_step": 3}, tmp_path / "plain.ckpt")
    with pytest.raises(UncommittedCheckpointError, match="is a file, not a checkpoint directory.*state_dict"):
        read_meta(tmp_path / "plain.ckpt")


def test_meta_matches_a_table_to_its_own_module_not_one_whose_path_is_a_prefix() -> None:
    # meta.json gave "ebc2.embedding_bags.t0.weight" the sharding type of module "ebc"'s table t0.
    from lightning_recsys.checkpoint.dcp_io import in_module

    assert in_module("ebc.embedding_bags.t0.weight", "ebc")
    assert not in_module("ebc2.embedding_bags.t0.weight", "ebc")
    assert in_module("embedding_bags.t0.weight", "")  # the model itself is the embedding module
