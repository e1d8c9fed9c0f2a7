"""Layering: the Trainer-free layers never import Lightning, nothing imports in a loop, "twod_rec" is registered."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "lightning_recsys"
TRAINER_FREE = [
    "lightning_recsys",
    *(f"lightning_recsys.parallel.{concern}" for concern in ("topology", "comms", "input", "sync", "sharding", "ranking")),
    "lightning_recsys.parallel",
    "lightning_recsys.planner.cost",
    "lightning_recsys.planner",
    "lightning_recsys.checkpoint",
]


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


def test_trainer_free_layers_do_not_import_lightning():
    # One fresh interpreter; after each import, nothing named lightning* may be loaded (modules only accumulate).
    out = _python(
        f"""
        import importlib, sys
        for name in {TRAINER_FREE!r}:
            importlib.import_module(name)
            loaded = sorted(m for m in sys.modules if m.startswith(("lightning", "pytorch_lightning")) and not m.startswith("lightning_recsys"))
            print(name, loaded[:5])
        """
    )
    for line in out.strip().splitlines():
        name, _, loaded = line.partition(" ")
        assert loaded == "[]", f"import {name} loaded Lightning: {loaded}"


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_recsys\nfrom lightning.pytorch import Trainer",
        "from lightning.pytorch import Trainer\nimport lightning_recsys",
    ],
    ids=["package-then-lightning", "lightning-then-package"],
)
def test_importing_the_package_registers_twod_rec_in_either_order(imports):
    out = _python(
        imports
        + """
from lightning.pytorch.strategies import StrategyRegistry
trainer = Trainer(strategy="twod_rec", accelerator="cpu", devices=2, logger=False)
print(type(trainer.strategy).__name__, "TorchRec" in StrategyRegistry["twod_rec"]["description"])
"""
    )
    assert out.strip().splitlines()[-1] == "TwoDRecStrategy True"


# ----------------------------------------------------------------------------------- import cycles
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _eager_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: module level (not under TYPE_CHECKING), and a module
    ``__getattr__`` (a lazy re-export is part of the module's face). Imports inside other functions are lazy."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                found.extend(n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))

    visit(tree.body)
    return found


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: module level, under ``TYPE_CHECKING`` and inside functions."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _import_graph(
    imports: Callable[[ast.Module], list[ast.Import | ast.ImportFrom]] = _eager_imports,
) -> dict[str, set[str]]:
    """Module -> the package modules its ``imports`` name: each target, and each package above a target that
    the importer is not itself inside (``import a.b.c`` runs ``a/b/__init__`` first)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                if not target.startswith(PACKAGE):
                    continue
                while target not in modules:  # `import a.b.name` where name is not a module
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for depth in range(1, len(parts) + 1):
                    runs = ".".join(parts[:depth])
                    inside = name == runs or name.startswith(runs + ".")
                    if runs != name and not inside and runs in modules:
                        graph[name].add(runs)
                if target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_package_modules():
    graph = _import_graph()
    assert "lightning_recsys.planner.stats" in graph["lightning_recsys.planner.balanced.planner"]
    assert "lightning_recsys.parallel" in graph["lightning_recsys.checkpoint.dcp_io"]  # runs parallel/__init__
    assert _cycles(graph) == []


def test_no_module_imports_another_that_imports_it_back_even_for_type_hints_or_lazily():
    # One direction between modules, whatever runs when: a type hint's import or a function's lazy import
    # back up the layers is still a loop a reader has to untangle (a helper takes a Protocol instead).
    graph = _import_graph(_every_import)
    assert "lightning_recsys.strategies.twod_rec" in graph["lightning_recsys.strategies"]
    assert "lightning_recsys.parallel.topology" in graph["lightning_recsys.parallel.comms.comm_accounting"]
    assert _cycles(graph) == []


def test_the_strict_graph_sees_type_checking_and_function_imports(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_recsys.high import High\n")
    (package / "high.py").write_text("def make():\n    from lightning_recsys import low\n")
    (package / "mid.py").write_text("import lightning_recsys.low\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert _cycles(_import_graph()) == []
    assert _cycles(_import_graph(_every_import)) == [["lightning_recsys.high", "lightning_recsys.low"]]


MAX_MODULE_LINES = 500
MAX_STRATEGY_LINES = 400  # strategies/twod_rec.py maps hooks; the mechanics live in its helper modules


def test_no_module_is_over_500_lines_and_the_strategy_is_at_most_400():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    too_long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by role): {too_long}"
    assert lines["lightning_recsys.strategies.twod_rec"] <= MAX_STRATEGY_LINES


# ----------------------------------------------------------------------------------- layers
# Contracts at the bottom; the single-device ranking above them; the models import neither the runtime
# (parallel/) nor the storage (checkpoint/): what they need from there comes through contracts/.
LAYER_RULES: dict[str, tuple[str, ...]] = {
    # layer -> the package layers it may import (besides itself)
    "lightning_recsys.contracts": (),
    "lightning_recsys.ranking": ("lightning_recsys.contracts",),
}
MODELS_MUST_NOT_IMPORT = ("lightning_recsys.parallel", "lightning_recsys.checkpoint", "lightning_recsys.strategies", "lightning_recsys.cli")


def _inside(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, targets in graph.items():
        for layer, allowed in LAYER_RULES.items():
            if not _inside(name, layer):
                continue
            for target in targets:
                if target != PACKAGE and not _inside(target, layer) and not any(_inside(target, a) for a in allowed):
                    found.append(f"{name} imports {target} ({layer} may import only {list(allowed) or 'itself'})")
        if _inside(name, "lightning_recsys.models"):
            found += [f"{name} imports {t} (models/ imports no runtime or storage layer)" for t in targets if any(_inside(t, b) for b in MODELS_MUST_NOT_IMPORT)]
    return sorted(found)


def test_models_import_no_runtime_and_contracts_import_no_other_layer():
    # Every import counts: module level, under TYPE_CHECKING and inside functions.
    graph = _import_graph(_every_import)
    assert "lightning_recsys.contracts.encoder" in graph["lightning_recsys.models.pretrainer"]
    assert _layer_violations(graph) == []


def test_contracts_import_nothing_heavier_than_torch():
    out = _python(
        """
        import sys
        import lightning_recsys.contracts
        print(sorted(m for m in sys.modules if m.startswith(("lightning", "pytorch_lightning", "torchrec", "fbgemm"))
                     and not m.startswith("lightning_recsys")))
        """
    )
    assert out.strip().splitlines()[-1] == "[]"


def test_the_layer_rules_catch_an_upward_import(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    for sub in ("contracts", "models", "parallel"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "contracts" / "names.py").write_text("from lightning_recsys.models import x\n")
    (package / "models" / "m.py").write_text("def f():\n    from lightning_recsys.parallel import y\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    problems = _layer_violations(_import_graph(_every_import))
    assert problems == [
        "lightning_recsys.contracts.names imports lightning_recsys.models (lightning_recsys.contracts may import only itself)",
        "lightning_recsys.models.m imports lightning_recsys.parallel (models/ imports no runtime or storage layer)",
    ]


# ----------------------------------------------------------------------------------- the test helpers
TESTING = "lightning_recsys.testing"
REPO = SRC.parent


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names a module's every import statement reaches (relative imports are the package's own)."""
    names = set()
    for node in _every_import(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def _repository_modules() -> set[str]:
    """What tests/ and benchmarks/ make importable by name (pytest's pythonpath): their modules and packages."""
    names = {"tests", "benchmarks"}
    for folder in (REPO / "tests", REPO / "benchmarks"):
        names |= {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    return names


def test_only_the_test_helpers_import_the_test_helpers_and_they_import_no_test_or_benchmark():
    graph = _import_graph(_every_import)
    assert "lightning_recsys.testing.oracle.core" in graph["lightning_recsys.testing.oracle.click"]
    users = sorted(f"{name} imports {t}" for name, targets in graph.items() if not _inside(name, TESTING) for t in targets if _inside(t, TESTING))
    assert users == [], "the product imports its test helpers"
    repository = _repository_modules()
    assert {"conftest", "docs_text", "quality", "emulated"} <= repository
    borrowed = {
        name: sorted(_top_level_imports(path) & repository) for name, path in _modules().items() if _inside(name, TESTING)
    }
    assert {name: found for name, found in borrowed.items() if found} == {}, "a test helper imports from tests/ or benchmarks/"


def test_the_oracle_trains_its_reference_without_a_process_group():
    # The unsharded reference is single-device: no module of the oracle imports torch.distributed (a sharded fit
    # gets its process group from the Trainer and the strategy it is given).
    oracle = {name: path for name, path in _modules().items() if _inside(name, f"{TESTING}.oracle")}
    assert f"{TESTING}.oracle.core" in oracle and len(oracle) >= 4
    for name, path in oracle.items():
        for node in _every_import(ast.parse(path.read_text(), str(path))):
            reached = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any(r == "torch.distributed" or r.startswith("torch.distributed.") for r in reached), f"{name} imports {reached}"
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                assert "distributed" not in {alias.name for alias in node.names}, name


def test_importing_the_test_helpers_imports_none_of_them():
    out = _python(
        f"""
        import sys
        import {TESTING}
        print(sorted(m for m in sys.modules if m.startswith("{TESTING}.")))
        """
    )
    assert out.strip().splitlines()[-1] == "[]"


def test_prepare_runs_without_importing_torch_or_lightning(tmp_path):
    # `lightning-recsys prepare` is a data job (DuckDB, pyarrow): torch and Lightning would add seconds and
    # hundreds of MiB to every run, on machines that may not train at all.
    (tmp_path / "events.csv").write_text("user_id,item_id\nu1,a\nu1,b\nu2,a\nu2,c\n")
    out = _python(
        f"""
        import sys
        from lightning_recsys.cli import main
        try:
            main(["prepare", "--input", {str(tmp_path / "events.csv")!r}, "--output", {str(tmp_path / "prepared")!r}])
        except SystemExit as exit:
            print("exit", exit.code)
        print("loaded", sorted(m for m in ("torch", "lightning", "torchrec", "fbgemm_gpu") if m in sys.modules))
        """
    )
    assert "exit 0" in out, out
    assert "loaded []" in out, out
    assert (tmp_path / "prepared" / "metadata.json").is_file()
