"""A model's embedding tables as planning sees them: read from the module once, then handed along.

``model_tables(module)`` walks the module's ``EmbeddingBagCollection``/``EmbeddingCollection``s, in
the order TorchRec's planner enumerates them; the pipeline, the statistics, the constraint checks,
the planners and the report take the resulting ``ModelTables`` instead of walking the module again.
A reshape changes the tables, so the pipeline reads them once more after it. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import BaseEmbeddingConfig


@dataclass(frozen=True)
class ModelTables:
    """The table configs of a module and the collection type each one is in (for its sharder)."""

    configs: tuple[BaseEmbeddingConfig, ...]
    collections: tuple[type[nn.Module], ...]  # EmbeddingBagCollection or EmbeddingCollection, per table

    def __post_init__(self) -> None:
        if len(self.configs) != len(self.collections):
            raise ValueError(
                f"ModelTables: {len(self.configs)} configs but {len(self.collections)} collection types; "
                "give one collection type per table (model_tables(module) builds both)."
            )

    def __iter__(self) -> Iterator[BaseEmbeddingConfig]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.configs]


def model_tables(module: nn.Module) -> ModelTables:
    """Every table of ``module``'s EmbeddingBagCollections and EmbeddingCollections, in module order."""
    configs: list[BaseEmbeddingConfig] = []
    collections: list[type[nn.Module]] = []
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            found: list[BaseEmbeddingConfig] = list(sub.embedding_bag_configs())
        elif isinstance(sub, EmbeddingCollection):
            found = list(sub.embedding_configs())
        else:
            continue
        configs += found
        collections += [type(sub)] * len(found)
    return ModelTables(configs=tuple(configs), collections=tuple(collections))


def embedding_tables(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """Every table config of the module's EmbeddingBagCollections and EmbeddingCollections."""
    return list(model_tables(module).configs)
