"""The layout of src/txl: every import statement (inside functions too) runs downward through the
packages, there are no import cycles, every module imports on its own, and no module is over 500 lines
without saying why.

The rule (docs/guide/architecture.md):

    errors < io < data < nn < fast < generate < models < eval < train < serve < bench < cli

A module may import its own package and lower ones. Imports under `if TYPE_CHECKING:` do not count (they
never run). The parent package a submodule's import runs first is not an edge (that is how Python packages
work, not a choice of the importing module).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "txl"

# txl.<package> -> its level; a module may import modules of its own level or lower ones.
ORDER = ("errors", "io", "data", "nn", "fast", "generate", "models", "eval", "train", "serve", "bench", "cli")
LEVEL = {name: rank for rank, name in enumerate(ORDER)}
LEVEL["allocator"] = LEVEL["errors"]  # a leaf beside errors (heap settings; imports nothing of txl)
LEVEL["argtypes"] = LEVEL["errors"]  # a leaf beside errors (command-line number types; imports only errors)
TOP = LEVEL["cli"]  # the package's own __init__ (the public API) sits with the entry point: only cli may import it
MAX_LINES = 500


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources(root: Path = SRC) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package __init__) for every module of txl under `root`."""
    return {module_name(path, root): (path.read_text(), path.name == "__init__.py")
            for path in sorted((root / "txl").rglob("*.py")) if path.name != "__main__.py"}


SOURCES = package_sources()
MODULES = sorted(SOURCES)


def level(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    return LEVEL.get(parts[1], TOP)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_statements(source: str) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module at any depth (functions, methods, try/if/with blocks), except
    the bodies of `if TYPE_CHECKING:` (their `else:` runs and counts)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
            return
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> dict[str, int]:
    """The txl modules `name` imports (at any depth) -> the line of the first such statement."""
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in import_statements(source):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for target in targets:
            while target and target not in modules:  # `import txl.a.b.attr`-like names: the module part
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    names = set(sources)
    return {name: imports_of(name, source, is_package, names) for name, (source, is_package) in sources.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(components)


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """'importer:line -> imported' for every import of a higher package than the importer's."""
    return sorted(f"{name}:{line} -> {target}" for name, targets in graph.items()
                  for target, line in targets.items() if level(target) > level(name))


def oversized(sources: dict[str, tuple[str, bool]], limit: int = MAX_LINES) -> list[str]:
    """Modules over `limit` lines whose docstring has no line starting "Size:" (the stated reason)."""
    out = []
    for name, (source, _) in sorted(sources.items()):
        lines = source.count("\n") + (not source.endswith("\n"))
        if lines <= limit:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if not any(line.strip().startswith("Size:") for line in doc.splitlines()):
            out.append(f"{name} ({lines} lines)")
    return out


# ---------------------------------------------------------------------------------------------
# The checker itself: it sees function-level imports, skips TYPE_CHECKING, and fails on a planted import


def test_the_walk_sees_imports_at_any_depth_and_skips_type_checking():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from txl.cli.main import main\n"
        "else:\n"
        "    import txl.io.files\n"
        "class A:\n"
        "    def f(self):\n"
        "        try:\n"
        "            from txl.train.loop import Trainer\n"
        "        except ImportError:\n"
        "            pass\n"
        "def g():\n"
        "    with open('x'):\n"
        "        from ..errors import UsageError\n"
    )
    modules = {"txl.data.corpus", "txl.data.sibling", "txl.cli.main", "txl.io.files", "txl.train.loop", "txl.errors"}
    found = imports_of("txl.data.corpus", source, False, modules)
    assert set(found) == {"txl.data.sibling", "txl.io.files", "txl.train.loop", "txl.errors"}
    assert found["txl.train.loop"] == 10


def test_a_planted_upward_import_or_cycle_makes_the_checker_fail():
    sources = dict(SOURCES)
    graph = import_graph(sources)
    upward_before, cycles_before = set(upward_imports(graph)), find_cycles(graph)
    # a function-level import of the trainer from the data package: upward
    corpus, is_package = sources["txl.data.corpus"]
    sources["txl.data.corpus"] = (corpus + "\n\ndef _planted():\n    from txl.train.loop import Trainer\n", is_package)
    # a function-level import of io from errors, which io imports: a cycle (and upward)
    errors, is_package = sources["txl.errors"]
    sources["txl.errors"] = (errors + "\n\ndef _planted():\n    import txl.io.files\n", is_package)
    graph = import_graph(sources)
    new = set(upward_imports(graph)) - upward_before
    assert any(v.startswith("txl.data.corpus:") and v.endswith("-> txl.train.loop") for v in new), new
    assert any(v.startswith("txl.errors:") and v.endswith("-> txl.io.files") for v in new), new
    assert any("txl.errors" in c and "txl.io.files" in c for c in find_cycles(graph)), cycles_before


def test_a_planted_upward_import_in_a_copy_of_the_package_fails(tmp_path):
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "txl", ignore=shutil.ignore_patterns("__pycache__", "*.toml"))
    target = tmp_path / "txl" / "io" / "files.py"
    target.write_text(target.read_text() + "\n\ndef _planted():\n    from txl.cli.main import main\n")
    violations = upward_imports(import_graph(package_sources(tmp_path)))
    assert any(v.startswith("txl.io.files:") and v.endswith("-> txl.cli.main") for v in violations)
    assert not any(v.startswith("txl.io.files:") for v in upward_imports(import_graph(SOURCES)))


def test_the_size_check_takes_a_stated_reason():
    long = "\n".join(f"x{i} = {i}" for i in range(MAX_LINES + 1)) + "\n"
    assert oversized({"txl.a": ('"""A module."""\n' + long, False)}) == [f"txl.a ({MAX_LINES + 2} lines)"]
    assert oversized({"txl.a": ('"""A module.\n\nSize: one table, kept whole.\n"""\n' + long, False)}) == []


# ---------------------------------------------------------------------------------------------
# The package as it is


def test_no_import_cycles_among_txl_modules_counting_imports_at_any_depth():
    graph = import_graph(SOURCES)
    assert "txl.eval.segments" in graph["txl.eval.api"]  # the walk sees the package's real edges
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_run_downward_through_the_packages():
    violations = upward_imports(import_graph(SOURCES))
    assert not violations, f"{len(violations)} imports of a higher package ({' < '.join(ORDER)}):\n" + "\n".join(violations)


def test_no_module_is_over_500_lines_without_a_stated_reason():
    too_long = oversized(SOURCES)
    assert not too_long, ("modules over 500 lines whose docstring has no line starting 'Size:' (the reason): "
                          + ", ".join(too_long))


def test_kernels_import_only_the_registry_and_masks_from_the_attention_package():
    graph = import_graph(SOURCES)
    for kernel in ("eager", "xl_fast", "sliding", "sparse", "performer", "linformer"):
        inside = {m for m in graph[f"txl.nn.attention.{kernel}"] if m.startswith("txl.nn.attention")}
        allowed = {"txl.nn.attention.registry", "txl.nn.attention.masks", "txl.nn.attention.eager", "txl.nn.attention.sliding",
                   "txl.nn.attention.pattern"}
        assert inside <= allowed, (kernel, inside - allowed)
        assert "txl.models.transformer_xl.model" not in graph[f"txl.nn.attention.{kernel}"]
    # the kernels' shared pieces (gathered attention, log-sum-exp merges) are a leaf beside the masks
    pattern = {m for m in graph["txl.nn.attention.pattern"] if m.startswith("txl")}
    assert pattern <= {"txl.nn.attention.masks"}, pattern


@pytest.mark.slow
def test_every_module_imports_on_its_own(tmp_path):
    """Each module first in a clean txl namespace (torch stays loaded): a cycle that Python would
    trip over (a name read from a partly initialised module) fails here."""
    code = (
        "import sys, importlib, torch\n"
        f"names = {MODULES!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'txl' or m.startswith('txl.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as err:\n"
        "        bad.append(f'{name}: {type(err).__name__}: {err}')\n"
        "print('\\n'.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", result.stdout
