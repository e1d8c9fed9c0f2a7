"""Every name and repository path that README.md and docs/*.md mention in inline code exists.

* ``lightning_recsys.<module>.<Name>``, and the package-relative ``parallel.runtime.ShardedRuntime`` form of a
  subpackage's module, import (a moved module or a renamed class fails here).
* ``from lightning_recsys... import A, B`` in prose imports (the code blocks run in test_docs_snippets.py).
* Every dotted ``lightning_recsys`` name in a fenced block (a YAML ``class_path:``, ``python -m ...``) and in
  ``examples/configs/*.yaml`` imports.
* Repository paths (``tests/...``, ``examples/...``, ``benchmarks/...``, ``scripts/...``, ``src/...``, and the package's
  own ``parallel/codecs.py`` form) and test files named alone (``test_x_integration.py``) exist.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from docs_text import FENCE, PAGES, ROOT, name, prose

PACKAGE = ROOT / "src" / "lightning_recsys"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
INLINE_CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"\blightning_recsys(?:\.\w+)+")
RELATIVE_DOTTED = re.compile(r"^(?:%s)(?:\.\w+)+$" % "|".join(SUBPACKAGES))
FROM_IMPORT = re.compile(r"\bfrom (lightning_recsys[\w.]*) import ([\w, ]+)")
REPOSITORY_PATH = re.compile(r"^(?:src|tests|examples|benchmarks|scripts|docs|lightning_recsys|%s)/(?:[\w./-]*\.\w+|[\w./-]*/)$" % "|".join(SUBPACKAGES))
TEST_FILE = re.compile(r"^test_\w+\.py$")
GENERATED = ("benchmarks/results/",)  # what the benchmarks write, not in the repository
PLACEHOLDER = re.compile(r"\btest_x[._]")  # "tests/unit/test_x.py beside ...": a naming rule, not a file


def inline_code(page: Path) -> list[str]:
    return INLINE_CODE.findall(prose(page.read_text()))


def resolves(dotted: str) -> bool:
    """``a.b.C``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        try:
            for attribute in parts[split:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def documented_names(page: Path) -> set[str]:
    names = set()
    for code in inline_code(page):
        names.update(DOTTED.findall(code))
        if RELATIVE_DOTTED.match(code):
            names.add(f"lightning_recsys.{code}")
        for module, imported in FROM_IMPORT.findall(code):
            names.update(f"{module}.{n.strip()}" for n in imported.split(",") if n.strip())
    return names


def path_exists(path: str) -> bool:
    bases = (ROOT, ROOT / "src", PACKAGE)
    return any((base / path.rstrip("/")).exists() for base in bases)


def documented_paths(page: Path) -> set[str]:
    return {code for code in inline_code(page) if REPOSITORY_PATH.match(code) and not code.startswith(GENERATED) and not PLACEHOLDER.search(code)}


def missing_files(page: Path) -> list[str]:
    missing = [path for path in sorted(documented_paths(page)) if not path_exists(path)]
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing += [code for code in sorted(set(inline_code(page))) if TEST_FILE.match(code) and code not in tests]
    return missing


def test_the_checks_can_fail():
    assert resolves("lightning_recsys.models.DLRMRanker") and resolves("lightning_recsys.parallel")
    assert not resolves("lightning_recsys.models.NoSuchRanker") and not resolves("lightning_recsys.no_such_module.X")
    assert path_exists("tests/docs_text.py") and path_exists("strategies/twod_rec.py")
    assert not path_exists("parallel/no_such_module.py")


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_documented_name_imports(page):
    unresolved = sorted(n for n in documented_names(page) if not resolves(n))
    assert not unresolved, f"{name(page)} names what does not import: {unresolved}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_documented_path_exists(page):
    missing = missing_files(page)
    assert not missing, f"{name(page)} mentions files the repository does not have: {missing}"


CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def code_block_names(text: str) -> set[str]:
    """Dotted ``lightning_recsys`` names in fenced blocks (``class_path:`` in YAML, ``python -m`` in shell, imports)."""
    return {dotted for m in FENCE.finditer(text) for dotted in DOTTED.findall(m.group(2))}


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_name_in_a_code_block_imports(page):
    unresolved = sorted(n for n in code_block_names(page.read_text()) if not resolves(n))
    assert not unresolved, f"{name(page)} has code blocks naming what does not import: {unresolved}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_name_in_an_example_config_imports(config):
    names = set(DOTTED.findall(config.read_text()))
    assert names, f"{config.name} names no lightning_recsys class (class_path:)"
    unresolved = sorted(n for n in names if not resolves(n))
    assert not unresolved, f"examples/configs/{config.name} names what does not import: {unresolved}"


def test_the_code_block_check_sees_a_moved_name():
    text = "```yaml\nstrategy:\n  class_path: lightning_recsys.parallel.qcomms.QCommsConfig\n```\n"
    assert code_block_names(text) == {"lightning_recsys.parallel.qcomms.QCommsConfig"}
    assert not resolves("lightning_recsys.parallel.qcomms.QCommsConfig")  # moved to parallel.comms
    assert resolves("lightning_recsys.parallel.comms.QCommsConfig")
