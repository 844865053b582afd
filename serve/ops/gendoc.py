"""One generated documentation file: the comparison, the write and the ``--write`` /
``--check`` command line that every single-file generator shares
(:mod:`serve.ops.configdoc`, :mod:`serve.ops.apidoc`; ``make check`` runs them).

A generator keeps its own ``render() -> str`` and ``DOC_PATH`` and hands them to
:func:`is_current`, :func:`write_file` and :func:`generator_main`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["REPO", "generator_main", "is_current", "write_file"]

#: The checkout this module lives in: the default root of every generated file.
REPO = Path(__file__).resolve().parents[2]


def is_current(root: Path | None, doc_path: Path, text: str) -> bool:
    """Whether ``root``/``doc_path`` exists and holds exactly ``text``."""
    path = (root or REPO) / doc_path
    return path.is_file() and path.read_text() == text


def write_file(root: Path | None, doc_path: Path, text: str) -> bool:
    """Write ``text`` to ``root``/``doc_path`` (folders created); whether it changed."""
    path = (root or REPO) / doc_path
    changed = not is_current(root, doc_path, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return changed


def generator_main(argv: list[str] | None, *, prog: str, description: str, doc_path: Path,
                   render: Callable[[], str]) -> int:
    """``python -m <prog> --write | --check [--root DIR]``: write the file, or exit 1
    (naming the command that fixes it) when it is missing or differs."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="(re)write the file")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when the file is missing or differs: CI runs it")
    p.add_argument("--root", type=Path, default=REPO,
                   help="repository root holding docs/ (default: this checkout)")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        changed = write_file(args.root, doc_path, text)
        print(f"wrote {doc_path}" if changed else f"{doc_path} was up to date")
        return 0
    if is_current(args.root, doc_path, text):
        return 0
    source = prog.replace(".", "/") + ".py"
    print(f"{doc_path} differs from what {source} renders; run python -m {prog} --write",
          file=sys.stderr)
    return 1
