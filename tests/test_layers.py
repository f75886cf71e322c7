"""The layer order of the product code: configs <- ops <- models <- quant <- engine <- scripts.

Every product module is parsed (never imported) and must:
  * import project modules only from its own layer or below;
  * import them at module level, never inside a function or class body (hidden imports dodge
    the cycle check below);
  * take part in no import cycle.
And importing engine.scheduler must not import jax (the host side is plain Python with numpy).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("configs", "ops", "models", "quant", "engine", "scripts")
RANK = {name: i for i, name in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    """Every module of the layer packages, by dotted name."""
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


MODULES = product_modules()


def resolve(name: str) -> str | None:
    """The product module an imported dotted name refers to (a module, or the module that
    defines the imported name), or None for a name outside the project."""
    if name.split(".")[0] not in RANK:
        return None
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[tuple[str, int, bool]]:
    """(imported product module, line, inside a function or class body) of every import."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, path.name == "__init__.py")


def imports_in(source: str, module: str, is_package: bool) -> list[tuple[str, int, bool]]:
    """imports_of for the source text of `module`."""
    tree = ast.parse(source, module)
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.ClassDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` names a module; `from mod import name` its module
                names = [f"{base}.{alias.name}" for alias in child.names]
            for name in names:
                target = resolve(name)
                edge = (target, child.lineno, nested)
                if target is not None and target != module and edge not in found:
                    found.append(edge)
            visit(child, inner)

    visit(tree, False)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def layer(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("package", LAYERS)
def test_no_upward_imports(package):
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} ({layer(target)} is above "
           f"{layer(m)})"
           for m, edges in GRAPH.items() if layer(m) == package
           for target, line, _ in edges if RANK[layer(target)] > RANK[layer(m)]]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", LAYERS)
def test_project_imports_at_module_level(package):
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} inside a function or class"
           for m, edges in GRAPH.items() if layer(m) == package
           for target, line, nested in edges if nested]
    assert not bad, "project imports hidden inside functions or classes:\n" + "\n".join(bad)


def import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def test_import_cycle_detection():
    """The checker finds a cycle hidden in a chain, and none in a tree."""
    assert import_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert import_cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []


def test_no_import_cycles():
    graph = {m: sorted({target for target, _, _ in edges}) for m, edges in GRAPH.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_layer_checker_sees_nested_and_relative_imports():
    source = ("import os\nfrom . import llama\nfrom ops import matmul as m\n"
              "class C:\n    def f(self):\n        from engine.runner import x\n")
    assert imports_in(source, "models.probe", False) == [
        ("models.llama", 2, False), ("ops.matmul", 3, False), ("engine.runner", 6, True)]


def test_scheduler_does_not_import_jax():
    code = "import sys, engine.scheduler; print(sorted(m for m in sys.modules if m == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", "importing engine.scheduler imports jax"
