"""The README and docs/ name only commands that exist, and the site lists every page.

Every ``make <target>`` in a code span or code block of README.md or docs/*.md must be a
target of the Makefile (parsed, never run), and every ``python -m <module>`` a module of
this checkout (a file or a package with ``__main__``) or of the environment. The README
stays a front door (at most :data:`README_MAX_LINES` lines), links only to files that
exist, and mkdocs.yml's nav lists every page of docs/. Nothing here runs a target or
builds the site (``make docs`` does, in ``make check``).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
#: The README is the front door; the manual is docs/.
README_MAX_LINES = 250
#: Top-level packages of this checkout: their modules must exist as files here.
_OWN = ("serve", "bench", "loadtest", "handlers", "examples", "tests", "scripts")
_FENCE = re.compile(r"^```.*?$(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"``?([^`\n]+)``?")
#: ``make`` then optional VAR=value assignments, then the target.
_MAKE = re.compile(r"(?:^|[\s;&|(`$])make\s+(?:-[A-Za-z]+\s+)*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
                   r"([a-z][a-z0-9-]*)")
_PYTHON_M = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
_TARGET = re.compile(r"^([a-zA-Z0-9][a-zA-Z0-9 _.-]*?)\s*:(?!=)", re.MULTILINE)
#: Words after ``make`` in code that are not targets.
_NOT_TARGETS = {"sure"}


def _doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _code(text: str) -> list[str]:
    """The code of a Markdown text: fenced blocks (comments dropped) and inline spans."""
    chunks = []
    for block in _FENCE.findall(text):
        chunks += [re.sub(r"(^|\s)#.*$", "", ln) for ln in block.splitlines()]
    prose = _FENCE.sub("", text)
    chunks += _SPAN.findall(prose)
    return chunks


def _mentions(pattern: re.Pattern[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in _doc_files():
        for chunk in _code(path.read_text()):
            for name in pattern.findall(chunk):
                if name not in _NOT_TARGETS:
                    found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def makefile_targets() -> set[str]:
    """Every target the Makefile defines (rule lines, not variable assignments)."""
    targets: set[str] = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith(("\t", "#", " ")) or "=" in line.split(":", 1)[0]:
            continue
        match = _TARGET.match(line)
        if match and not line.split(":", 1)[1].startswith("="):
            targets.update(match.group(1).split())
    return targets


def _module_exists(module: str) -> bool:
    parts = module.split(".")
    if parts[0] in _OWN:
        base = REPO.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    return importlib.util.find_spec(parts[0]) is not None and (
        len(parts) == 1 or importlib.util.find_spec(module) is not None)


def test_the_extractors_find_what_they_should():
    text = ("Run `make run`, or `SIDECAR_PORT=8190 make run`; make sure.\n"
            "```bash\nmake up TS_INFERENCE_PORT=8180 && make model SEED=7  # make nothing\n"
            "python -m serve.ops.apidoc --write\n```\n")
    chunks = _code(text)
    assert sorted({t for c in chunks for t in _MAKE.findall(c)}) == ["model", "run", "up"]
    assert {m for c in chunks for m in _PYTHON_M.findall(c)} == {"serve.ops.apidoc"}
    assert {"run", "up", "docs", "check", "test-fast", "ts-limits"} <= makefile_targets()
    assert "SEED" not in makefile_targets() and "PY" not in makefile_targets()


def test_every_make_target_mentioned_exists():
    targets = makefile_targets()
    mentions = _mentions(_MAKE)
    assert {"run", "test", "docs", "check"} <= set(mentions), "the extractor found too little"
    missing = {t: sorted(where) for t, where in mentions.items() if t not in targets}
    assert not missing, f"make targets named in the docs but not in the Makefile: {missing}"


def test_every_python_module_mentioned_exists():
    mentions = _mentions(_PYTHON_M)
    assert {"serve.ops.apidoc", "serve.ops.benchdoc", "serve.model.importer"} <= set(mentions)
    missing = {m: sorted(where) for m, where in mentions.items() if not _module_exists(m)}
    assert not missing, f"python -m modules named in the docs that do not exist: {missing}"


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; keep it at most {README_MAX_LINES}: move "
        "reference and how-to text into docs/ and link it")
    text = "\n".join(lines)
    for needed in ("make run", "make test", "/predictions/dlrm", "docs/own-model.md",
                   "## Benchmarks", "<!-- BENCHMARKS -->"):
        assert needed in text, needed


def test_the_readme_links_only_to_files_that_exist():
    text = _FENCE.sub("", README.read_text())
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "no links found"
    missing = [link for link in links
               if not link.startswith(("http://", "https://")) and not (REPO / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_the_nav_lists_every_docs_page():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), "a page is in the nav twice"
    assert sorted(nav) == pages, (
        f"not in mkdocs.yml's nav: {sorted(set(pages) - set(nav))}; "
        f"in the nav but not in docs/: {sorted(set(nav) - set(pages))}")


@pytest.mark.parametrize("slot", ["oip.md", "autoscaling.md", "benchmarks-slo.md"])
def test_the_pages_other_branches_fill_have_their_nav_slot(slot):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert slot in _nav_pages(config["nav"])
    assert (DOCS / slot).is_file()
