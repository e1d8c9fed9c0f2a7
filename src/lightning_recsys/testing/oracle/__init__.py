"""The correctness oracle: a tiny model trained unsharded with plain SGD in one process on the global batches,
which sharded runs under ``TwoDRecStrategy`` are compared against.

One workload per module, each with the same API (``core.Oracle``'s methods bound to module names):

- ``click``: a ``DLRMRanker`` on a synthetic click log;
- ``sequence``: a ``SequenceRanker`` on hand-made sequence batches;
- ``pretrain``: a ``SequencePretrainer`` on hand-made batches with shared negatives.

Each has ``STEPS``, ``EMBEDDING_LR``, ``DENSE_LR``, ``DIM``, ``TABLES``, ``CONFIG`` (its data),
``make_model(embedding_device=None, seed=1234, *, cls=..., **overrides)``, ``is_table(key)``,
``global_batch(config, split, index)``, ``rank_batch(config, split, index, rank, world_size)`` and:

- ``train_unsharded(world_size=1, *, model=None, config=None, steps=None, **overrides) -> Expected(state, predictions)``;
- ``fit_sharded(rank, world_size, strategy, *, model=None, config=None, steps=None, devices=None, num_nodes=1,
  accelerator="cpu", callbacks=None) -> Fitted(model, trainer, predictions)``;
- ``sgd_strategy(*, sharding_types=None, column_width=None, validate_inputs="error", check_finite=False, **kwargs)``;
- ``shards_of(model)`` (every compared tensor) and ``table_shards(model)`` (the tables): this rank's pieces;
- ``local_predictions(model, rank, world_size, config=None)`` and ``assert_matches(shards, predictions, state, predictions)``.

Here: ``assemble`` (the ranks' pieces into one tensor), ``RecordPipeline``, ``Shards``, ``Expected``, ``Fitted``.
"""

from lightning_recsys.testing.oracle.core import Expected, Fitted, Oracle, RecordPipeline, Shards, assemble

__all__ = ["Expected", "Fitted", "Oracle", "RecordPipeline", "Shards", "assemble"]
