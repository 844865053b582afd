"""Code shape: size belongs in named parts, not in a few rooms.

- no function in ``serve/``, ``handlers/``, ``loadtest/`` or ``bench/`` runs over 80 lines
  (a function that long does several things: split it into named steps);
- no class in those folders runs over 300 lines (a class that long has several jobs: split
  it into objects that own their state);
- no module in ``serve/`` runs over 800 lines (one concept per module);
- nothing in ``serve/`` imports a ``_private`` name from another module (a helper two
  modules share is public where it is defined).

Measured with ``ast`` from the ``def``/``class`` line to the last line of the body
(decorators not counted); a module's length is its number of lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layers import imports_of, module_name

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("serve", "handlers", "loadtest", "bench")
MAX_LINES = 80
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 800


def _trees(roots: tuple[str, ...], base: Path = REPO) -> list[tuple[str, ast.AST]]:
    return [(path.relative_to(base).as_posix(),
             ast.parse(path.read_text(), filename=str(path)))
            for root in roots for path in sorted((base / root).rglob("*.py"))]


def long_functions(roots: tuple[str, ...] = ROOTS,
                   max_lines: int = MAX_LINES) -> list[tuple[str, str, int]]:
    """(path:line, qualified name, lines) of each function over ``max_lines``."""
    found = []
    for path, tree in _trees(roots):
        found += _walk(tree, path, "", max_lines)
    return found


def _walk(node: ast.AST, path: str, prefix: str, max_lines: int,
          kinds: tuple[type, ...] = (ast.FunctionDef, ast.AsyncFunctionDef)
          ) -> list[tuple[str, str, int]]:
    """(path:line, qualified name, lines) of every node of ``kinds`` over ``max_lines``,
    nested ones included."""
    out = []
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if isinstance(child, kinds):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > max_lines:
                    out.append((f"{path}:{child.lineno}", name, lines))
            name += "."
        out += _walk(child, path, name, max_lines, kinds)
    return out


def long_classes(roots: tuple[str, ...] = ROOTS,
                 max_lines: int = MAX_CLASS_LINES) -> list[tuple[str, str, int]]:
    """(path:line, qualified name, lines) of each class over ``max_lines``."""
    found = []
    for path, tree in _trees(roots):
        found += _walk(tree, path, "", max_lines, (ast.ClassDef,))
    return found


def long_modules(root: str = "serve", max_lines: int = MAX_MODULE_LINES,
                 base: Path = REPO) -> list[tuple[str, int]]:
    """(path, lines) of each module under ``root`` over ``max_lines``."""
    out = []
    for path in sorted((base / root).rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out.append((path.relative_to(base).as_posix(), n))
    return out


def private_imports(root: str = "serve", base: Path = REPO) -> list[str]:
    """``path:line dotted.name`` for each import under ``root`` of a ``_private`` name of
    another ``serve`` module (lazy and relative imports included, read by the layer
    test's :func:`~tests.test_layers.imports_of`)."""
    found = []
    for path in sorted((base / root).rglob("*.py")):
        for line, name in imports_of(path, module_name(path, base)):
            last = name.rpartition(".")[2]
            if (name.split(".")[0] == "serve" and last.startswith("_")
                    and not last.startswith("__")):
                found.append(f"{path.relative_to(base).as_posix()}:{line} {name}")
    return found


def _report(found: list[tuple[str, str, int]]) -> str:
    return "\n".join(f"  {where} {name}: {n} lines" for where, name, n in found)


def test_no_function_is_over_80_lines():
    found = long_functions()
    assert not found, (f"functions over {MAX_LINES} lines (split them into named steps):\n"
                       f"{_report(found)}")


def test_no_class_is_over_300_lines():
    found = long_classes()
    assert not found, (f"classes over {MAX_CLASS_LINES} lines (split them into objects "
                       f"that own their state):\n{_report(found)}")


def test_no_module_in_serve_is_over_800_lines():
    found = long_modules()
    assert not found, (f"modules over {MAX_MODULE_LINES} lines (one concept per module):\n"
                       + "\n".join(f"  {p}: {n} lines" for p, n in found))


def test_nothing_in_serve_imports_a_private_name_from_another_module():
    found = private_imports()
    assert not found, ("private names imported across modules (make the helper public "
                       "where it is defined):\n" + "\n".join(f"  {f}" for f in found))


def test_the_walk_finds_a_long_nested_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"class C:\n    def f(self):\n{body}\n")
    assert _walk(tree, "m.py", "", MAX_LINES) == [("m.py:2", "C.f", MAX_LINES + 1)]


def test_the_walk_finds_a_long_class_and_not_its_short_methods():
    methods = "\n".join(f"    def f{i}(self):\n        return {i}\n" for i in range(110))
    tree = ast.parse("class Outer:\n    class C:\n"
                     + "\n".join("    " + line for line in methods.splitlines()) + "\n")
    found = _walk(tree, "m.py", "", MAX_CLASS_LINES, (ast.ClassDef,))
    assert [(w, n) for w, n, _ in found] == [("m.py:1", "Outer"), ("m.py:2", "Outer.C")]
    assert _walk(tree, "m.py", "", MAX_LINES) == []


def test_the_module_and_private_import_checks_see_a_planted_file(tmp_path):
    pkg = tmp_path / "serve" / "x"
    pkg.mkdir(parents=True)
    (pkg / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (pkg / "uses.py").write_text("def f():\n    from serve.x.big import _helper\n"
                                 "from .big import _other, public, __version__\n")
    assert long_modules("serve", base=tmp_path) == [("serve/x/big.py", MAX_MODULE_LINES + 1)]
    assert private_imports("serve", base=tmp_path) == [
        "serve/x/uses.py:2 serve.x.big._helper", "serve/x/uses.py:3 serve.x.big._other"]
