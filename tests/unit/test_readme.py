"""The README's configuration reference lists exactly the arguments in the code, with the same defaults."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from lightning_recsys import (
    CommunicationMonitor,
    EmbeddingOptimizerConfig,
    GuardConfig,
    PlanningConfig,
    QCommsConfig,
    ReplicaSyncConfig,
    TableConstraints,
    TwoDRecStrategy,
)
from lightning_recsys.callbacks import RunSummary
from lightning_recsys.data import CriteoBinaryDataModule, CriteoDataModule, MovieLens100KDataModule, SyntheticClickLogConfig
from lightning_recsys.models import DCNRanker, DLRMRanker

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
# Lightning fills these in; the reference says so in prose.
LIGHTNING_PLUMBING = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
SECTIONS = {
    "`TwoDRecStrategy`": [TwoDRecStrategy],
    "`PlanningConfig`": [PlanningConfig],
    "`GuardConfig`": [GuardConfig],
    "`EmbeddingOptimizerConfig`": [EmbeddingOptimizerConfig],
    "`QCommsConfig`": [QCommsConfig],
    "`ReplicaSyncConfig`": [ReplicaSyncConfig],
    "`TableConstraints`": [TableConstraints],
    "`DLRMRanker` and `DCNRanker`": [DLRMRanker, DCNRanker],
    "`SyntheticClickLogConfig`": [SyntheticClickLogConfig],
    "`MovieLens100KDataModule`": [MovieLens100KDataModule],
    "`CriteoDataModule`": [CriteoDataModule],
    "`CriteoBinaryDataModule`": [CriteoBinaryDataModule],
    "Callbacks": [CommunicationMonitor, RunSummary],
}


def _table(heading: str) -> dict[str, str]:
    reference = README[README.index("## Configuration reference") :]
    section = reference[reference.index(f"### {heading}\n") :]
    section = section[: section.find("\n### ", 4) if "\n### " in section[4:] else section.find("\n## ")]
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
        params.update({n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n not in {"self", *LIGHTNING_PLUMBING}})
    assert set(documented) == set(params), f"README {heading}: missing {set(params) - set(documented)}, stale {set(documented) - set(params)}"
    for name, param in params.items():
        cell = documented[name]
        if param.default is inspect.Parameter.empty:
            assert cell == "required", f"{heading}.{name}: README says {cell!r}, the code has no default"
        elif cell.startswith("`"):
            literal = cell[1 : cell.index("`", 1)]
            default = _factory_defaults(SECTIONS[heading]).get(name, param.default)
            assert ast.literal_eval(literal) == default, f"{heading}.{name}: README {literal}, code {default!r}"
