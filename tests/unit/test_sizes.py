"""What a reader can hold at once: no module of `shared/`, `services/` or `functions/` over 400 lines, and no
function over 60 unless its docstring says why ("on purpose")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "services", "functions")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def shipped_modules() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def test_no_module_is_over_400_lines() -> None:
    modules = shipped_modules()
    assert len(modules) > 50  # the walk found the package
    long = [f"{path.relative_to(ROOT)}: {n}" for path in modules
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


def test_no_function_is_over_60_lines_without_a_stated_reason() -> None:
    long = []
    for path in shipped_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and "on purpose" not in (ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length}")
    assert long == []
