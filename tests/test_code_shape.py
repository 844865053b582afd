"""Code shape: no function in serve/, handlers/ or loadtest/ runs over 80 lines.

A function that long does several things; split it into named steps. Measured with
``ast`` from the ``def`` line to the last line of the body (decorators not counted).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("serve", "handlers", "loadtest")
MAX_LINES = 80


def long_functions(roots: tuple[str, ...] = ROOTS,
                   max_lines: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(path:line, qualified name, lines) of each function over ``max_lines``."""
    found = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            found += _walk(tree, path.relative_to(REPO).as_posix(), "", max_lines)
    return found


def _walk(node: ast.AST, path: str, prefix: str,
          max_lines: int) -> list[tuple[str, str, int]]:
    out = []
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > max_lines:
                    out.append((f"{path}:{child.lineno}", name, lines))
            name += "."
        out += _walk(child, path, name, max_lines)
    return out


def test_no_function_is_over_80_lines():
    found = long_functions()
    assert not found, "functions over {} lines (split them into named steps):\n{}".format(
        MAX_LINES, "\n".join(f"  {where} {name}: {n} lines" for where, name, n in found))


def test_the_walk_finds_a_long_nested_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"class C:\n    def f(self):\n{body}\n")
    assert _walk(tree, "m.py", "", MAX_LINES) == [("m.py:2", "C.f", MAX_LINES + 1)]
