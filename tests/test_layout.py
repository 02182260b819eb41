"""The layout of src/txl: imports run downward (no cycles), and every module imports on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "txl"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__main__.py"}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(name: str) -> set[str]:
    """The txl modules `name` imports when it is imported: statements at module level (also inside
    try/if, but not `if TYPE_CHECKING:`); imports inside functions run later and are not edges. A
    package's own submodules imported by its `__init__` are edges like any other; the parent package a
    submodule's import runs first is not (that is how Python packages work, not a cycle)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in MODULES and m != name}


def test_no_import_cycles_among_txl_modules():
    graph = {name: module_level_imports(name) for name in MODULES}
    assert graph["txl.models.transformer_xl.model"] >= {"txl.nn.attention.layer", "txl.nn.memory", "txl.nn.positional", "txl.fast"}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_import_only_the_registry_and_masks_from_the_attention_package():
    for kernel in ("eager", "xl_fast", "sliding", "sparse", "performer", "linformer"):
        inside = {m for m in module_level_imports(f"txl.nn.attention.{kernel}") if m.startswith("txl.nn.attention")}
        allowed = {"txl.nn.attention.registry", "txl.nn.attention.masks", "txl.nn.attention.eager", "txl.nn.attention.sliding",
                   "txl.nn.attention.pattern"}
        assert inside <= allowed, (kernel, inside - allowed)
        assert "txl.nn.attention.layer" not in inside and "txl.models.transformer_xl.model" not in module_level_imports(f"txl.nn.attention.{kernel}")
    # the kernels' shared pieces (gathered attention, log-sum-exp merges) are a leaf beside the masks
    pattern = {m for m in module_level_imports("txl.nn.attention.pattern") if m.startswith("txl")}
    assert pattern <= {"txl.nn.attention.masks"}, pattern


def test_every_module_imports_on_its_own(tmp_path):
    """Each module first in a clean txl namespace (torch stays loaded): a cycle that Python would
    trip over (a name read from a partly initialised module) fails here."""
    code = (
        "import sys, importlib, torch\n"
        f"names = {sorted(MODULES)!r}\n"
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
