"""docs/configuration.md (the configuration reference) lists exactly the arguments in the code, with the same defaults."""

import ast
import dataclasses
import inspect
import re
import pytest
from docs_text import page

from lightning_recsys import (
    CommunicationMonitor,
    DCPCheckpointIO,
    EmbeddingOptimizerConfig,
    GuardConfig,
    PlanningConfig,
    QCommsConfig,
    ReplicaSyncConfig,
    TableConstraints,
    TwoDRecStrategy,
)
from lightning_recsys.callbacks import InitFromCheckpoint, RunSummary
from lightning_recsys.data import (
    CriteoBinaryDataModule,
    CriteoDataModule,
    MovieLens100KDataModule,
    MovieLens100KSequenceDataModule,
    MovieLensPretrainDataModule,
    SequenceFileDataModule,
    SyntheticClickLogDataModule,
    SyntheticPretrainDataModule,
    SyntheticSequenceDataModule,
)
from lightning_recsys.models import DCNRanker, DLRMRanker, SequencePretrainer, SequenceRanker

REFERENCE_PAGE = "docs/configuration.md"
REFERENCE = page(REFERENCE_PAGE)
# Lightning fills these in; the reference says so in prose.
LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
SECTIONS = {
    "`TwoDRecStrategy`": [TwoDRecStrategy],
    "`DCPCheckpointIO`": [DCPCheckpointIO],
    "`PlanningConfig`": [PlanningConfig],
    "`GuardConfig`": [GuardConfig],
    "`EmbeddingOptimizerConfig`": [EmbeddingOptimizerConfig],
    "`QCommsConfig`": [QCommsConfig],
    "`ReplicaSyncConfig`": [ReplicaSyncConfig],
    "`TableConstraints`": [TableConstraints],
    "`DLRMRanker` and `DCNRanker`": [DLRMRanker, DCNRanker],
    "`SequenceRanker`": [SequenceRanker],
    "`SyntheticClickLogDataModule`": [SyntheticClickLogDataModule],
    "`MovieLens100KDataModule`": [MovieLens100KDataModule],
    "`SyntheticSequenceDataModule`": [SyntheticSequenceDataModule],
    "`MovieLens100KSequenceDataModule`": [MovieLens100KSequenceDataModule],
    "`SequencePretrainer`": [SequencePretrainer],
    "`SequenceFileDataModule`": [SequenceFileDataModule],
    "`SyntheticPretrainDataModule`": [SyntheticPretrainDataModule],
    "`MovieLensPretrainDataModule`": [MovieLensPretrainDataModule],
    "`CriteoDataModule`": [CriteoDataModule],
    "`CriteoBinaryDataModule`": [CriteoBinaryDataModule],
    "Callbacks": [CommunicationMonitor, RunSummary, InitFromCheckpoint],
}


def _table(heading: str) -> dict[str, str]:
    assert f"\n## {heading}\n" in REFERENCE, f"{REFERENCE_PAGE} has no section '## {heading}'"
    section = REFERENCE[REFERENCE.index(f"\n## {heading}\n") + 1 :]
    end = section.find("\n## ", 3)
    section = section if end < 0 else section[:end]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.MULTILINE)
    return {name: default.strip() for name, default in rows}


def _factory_defaults(classes: list[type]) -> dict[str, object]:
    """A dataclass field's ``default_factory()`` (the signature shows only ``<factory>``)."""
    return {
        f.name: f.default_factory()
        for cls in classes if dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING
    }


CONFIGS = [PlanningConfig, GuardConfig, EmbeddingOptimizerConfig, QCommsConfig, ReplicaSyncConfig, TableConstraints]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_is_documented_in_its_docstring(config):
    documented = set(re.findall(r"^\s{8}(\w+)(?: / \w+)*:", config.__doc__ or "", flags=re.MULTILINE))
    documented |= {name for group in re.findall(r"^\s{8}(\w+(?: / \w+)+):", config.__doc__ or "", flags=re.MULTILINE) for name in group.split(" / ")}
    missing = {f.name for f in dataclasses.fields(config) if not f.name.startswith("_")} - documented
    assert not missing, f"{config.__name__}'s docstring (Args:) does not document {sorted(missing)}"


@pytest.mark.parametrize("heading", list(SECTIONS))
def test_reference_table_matches_the_signature(heading):
    documented = _table(heading)
    params: dict[str, inspect.Parameter] = {}
    for cls in SECTIONS[heading]:
        params.update({
            n: p for n, p in inspect.signature(cls.__init__).parameters.items()
            # *args / **kwargs are no arguments a config sets (the synthetic DataModules refuse the old config with them)
            if n not in {"self", *LIGHTNING_PLUMBING} and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        })
    assert set(documented) == set(params), f"{REFERENCE_PAGE} {heading}: missing {set(params) - set(documented)}, stale {set(documented) - set(params)}"
    for name, param in params.items():
        cell = documented[name]
        if param.default is inspect.Parameter.empty:
            assert cell == "required", f"{heading}.{name}: {REFERENCE_PAGE} says {cell!r}, the code has no default"
        elif cell.startswith("`"):
            literal = cell[1 : cell.index("`", 1)]
            default = _factory_defaults(SECTIONS[heading]).get(name, param.default)
            assert ast.literal_eval(literal) == default, f"{heading}.{name}: {REFERENCE_PAGE} {literal}, code {default!r}"
