"""The PALLASITE_* environment variables are read in one module, configs/switches.py.

Every product module (configs, ops, models, quant, engine, scripts) is parsed, never imported:
none but configs/switches.py may read a variable named by a "PALLASITE_..." literal through
os.environ.get / os.getenv / os.environ[...] / `in os.environ` (or environ.pop, setdefault).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from configs.switches import Switches

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("configs", "ops", "models", "quant", "engine", "scripts")
SWITCH_MODULE = ROOT / "configs" / "switches.py"
ENV_METHODS = ("get", "pop", "setdefault")


def is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id == "environ"))


def is_switch_name(node: ast.AST) -> bool:
    return (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.startswith("PALLASITE_"))


def switch_reads(source: str, name: str = "<source>") -> list[tuple[int, str]]:
    """(line, variable) of every read of a PALLASITE_* variable in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and node.args and is_switch_name(node.args[0]):
            func = node.func
            getenv = ((isinstance(func, ast.Attribute) and func.attr == "getenv")
                      or (isinstance(func, ast.Name) and func.id == "getenv"))
            method = (isinstance(func, ast.Attribute) and func.attr in ENV_METHODS
                      and is_environ(func.value))
            if getenv or method:
                found.append((node.lineno, node.args[0].value))
        elif (isinstance(node, ast.Subscript) and is_environ(node.value)
              and is_switch_name(node.slice)):
            found.append((node.lineno, node.slice.value))
        elif (isinstance(node, ast.Compare) and is_switch_name(node.left)
              and any(is_environ(c) for c in node.comparators)):
            found.append((node.lineno, node.left.value))
    return found


def product_files() -> list[Path]:
    return [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]


def test_only_the_switch_module_reads_pallasite_variables():
    files = product_files()
    assert SWITCH_MODULE in files and len(files) > 50  # the walk sees the product
    offenders = [f"{path.relative_to(ROOT)}:{line} reads {variable}"
                 for path in files if path != SWITCH_MODULE
                 for line, variable in switch_reads(path.read_text(), str(path))]
    assert not offenders, "read PALLASITE_* through configs.switches.Switches:\n" + "\n".join(
        offenders)


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ.get("PALLASITE_ATTENTION", "")',
    'import os\nx = os.getenv("PALLASITE_GEMV")',
    'import os\nx = os.environ["PALLASITE_WGMMA"]',
    'from os import environ\nx = "PALLASITE_API_KEY" in environ',
    'import os\nx = os.environ.pop("PALLASITE_K_ORDER", None)',
])
def test_each_form_of_read_is_found(source):
    assert [v for _, v in switch_reads(source)][0].startswith("PALLASITE_")


def test_other_variables_and_mentions_are_not_reads():
    source = ('"""Set PALLASITE_ATTENTION=reference to debug."""\nimport os\n'
              'x = os.environ.get("XLA_FLAGS", "")\nhelp = "PALLASITE_API_KEY, if set"\n')
    assert switch_reads(source) == []


def test_the_api_key_is_a_switch_kept_verbatim():
    assert Switches.from_env({"PALLASITE_API_KEY": "Se cret"}).api_key == "Se cret"
    assert Switches.from_env({"PALLASITE_API_KEY": ""}).api_key is None
    assert Switches.from_env({}) == Switches()
