"""The docs generators: docs/sidecar-api.md from the sidecar's OpenAPI schema
(:mod:`serve.ops.apidoc`) and the dated benchmark pages (:mod:`serve.ops.benchdoc`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from serve.ops import apidoc, benchdoc

REPO = Path(__file__).resolve().parents[1]
_NAV = f"""site_name: t
nav:
  - Home: index.md
  - Benchmarks:
      - Results: benchmarks/index.md
      {benchdoc.NAV_BEGIN}
      {benchdoc.NAV_END}
"""


# --------------------------------------------------------------------------- apidoc


def test_the_sidecar_api_page_is_current():
    assert apidoc.check(), ("docs/sidecar-api.md is stale: run "
                            "python -m serve.ops.apidoc --write and commit it")


def test_the_api_page_names_every_route_and_schema():
    schema = apidoc.openapi_schema()
    text = apidoc.render(schema)
    for path, item in schema["paths"].items():
        for method in item:
            assert f"### `{method.upper()} {path}`" in text
    for name in schema["components"]["schemas"]:
        assert f"### {name}\n" in text


def test_the_api_page_renders_fields_bounds_and_statuses():
    schema = {
        "info": {"title": "t", "description": "A sidecar.", "version": "9"},
        "paths": {"/x": {"put": {
            "summary": "Change x", "security": [{"HTTPBearer": []}],
            "requestBody": {"content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/X"}}}},
            "responses": {"200": {"description": "ok"},
                          "409": {"description": "busy | try later"}}}}},
        "components": {"schemas": {"X": {
            "description": "The ``x`` body.", "additionalProperties": False,
            "required": ["n"],
            "properties": {"n": {"type": "integer", "minimum": 1.0, "maximum": 64,
                                 "description": "how many"},
                           "mode": {"enum": ["a", "b"], "default": "a"}}}}},
    }
    text = apidoc.render(schema)
    assert "| PUT | `/x` | Change x |" in text
    assert "Request body: `application/json`: [X](#x)." in text
    assert "| 409 | busy \\| try later |  |" in text
    assert "Needs the bearer token" in text
    assert "| `n` | integer | yes |  | >= 1, <= 64 | how many |" in text
    assert '| `mode` | one of `a`, `b` |  | `"a"` |  |  |' in text
    assert "The `x` body." in text and "Unknown fields are refused." in text
    assert "API version 9." in text


def test_apidoc_check_fails_on_a_stale_copy(tmp_path: Path):
    assert apidoc.main(["--check", "--root", str(tmp_path)]) == 1
    assert apidoc.main(["--write", "--root", str(tmp_path)]) == 0
    assert apidoc.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / apidoc.DOC_PATH
    page.write_text(page.read_text() + "edited by hand\n")
    assert apidoc.main(["--check", "--root", str(tmp_path)]) == 1


# --------------------------------------------------------------------------- benchdoc


def _root(tmp_path: Path) -> Path:
    (tmp_path / "mkdocs.yml").write_text(_NAV)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    return tmp_path


def test_a_result_becomes_a_dated_page_with_its_command(tmp_path: Path):
    root = _root(tmp_path)
    result = {"measured_at": "2026-12-01T10:00:00Z",
              "rows": [{"form": "rows", "instances": 512, "after_ms": 5.14},
                       {"form": "binary", "instances": 512, "after_ms": 0.068}],
              "machine": {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "avx512_bf16"],
                          "logical_cores": 2, "usable_cores": 2, "torch": "2.13.0+cpu",
                          "cores": 2}}
    (root / "bench" / "results" / "decode.json").write_text(json.dumps(result))
    changed = benchdoc.write(root)
    page = root / "docs" / "benchmarks" / "2026-12-01-decode.md"
    assert page in changed
    text = page.read_text()
    assert text.startswith("<!-- benchdoc: ")
    assert "# Request decoding, 2026-12-01" in text
    assert "- **Command:** `python -m bench.bench_decode`" in text
    assert "2026-12-01T10:00:00Z (from the result's `measured_at`)" in text
    assert "| form | instances | after_ms |" in text and "| binary | 512 | 0.068 |" in text
    assert "| `cores` | 2 |" in text
    assert ("- **Machine:** AMD EPYC, 2 cores (2 usable), avx2 avx512_bf16, no AMX, "
            "torch 2.13.0+cpu\n") in text
    index = (root / "docs" / "benchmarks" / "index.md").read_text()
    assert ("| 2026-12-01 | [Request decoding](2026-12-01-decode.md) "
            "| `python -m bench.bench_decode` |") in index
    nav = (root / "mkdocs.yml").read_text()
    assert '      - "2026-12-01: Request decoding": benchmarks/2026-12-01-decode.md\n' in nav
    assert benchdoc.check(root) == []
    assert benchdoc.write(root) == []


def test_a_result_without_a_date_takes_the_file_time_and_says_so(tmp_path: Path):
    root = _root(tmp_path)
    path = root / "bench" / "results" / "mystery.json"
    path.write_text(json.dumps({"command": "python -m bench.mystery --fast", "x": 1.5,
                                "t_s": [float(i) for i in range(100)], "few": [1, 2]}))
    os.utime(path, (1764547200, 1764547200))  # 2025-12-01T00:00:00Z
    benchdoc.write(root)
    text = (root / "docs" / "benchmarks" / "2025-12-01-mystery.md").read_text()
    assert "`python -m bench.mystery --fast`" in text
    assert "| `t_s` | 100 values, min 0, max 99, first 0, last 99 |" in text
    assert "| `few` | [1,2] |" in text
    assert "the result file's modification time: the result records no date" in text
    assert "- **Machine:** not recorded by this result" in text



def test_a_date_in_the_results_meta_is_its_date(tmp_path: Path):
    root = _root(tmp_path)
    (root / "bench" / "results" / "slo.json").write_text(json.dumps(
        {"runs": [{"model": "small", "queries_per_s": 61.1}],
         "meta": {"created_at": "2026-12-06T04:21:20Z", "machine": {"cpu_model": "AMD EPYC"}}}))
    benchdoc.write(root)
    text = (root / "docs" / "benchmarks" / "2026-12-06-slo.md").read_text()
    assert "- **Measured:** 2026-12-06T04:21:20Z (from the result's `meta.created_at`)" in text
    assert "- **Machine:** AMD EPYC, " in text


def test_committed_pages_stay_listed_without_their_result_files(tmp_path: Path):
    root = _root(tmp_path)
    results = root / "bench" / "results"
    (results / "faults.json").write_text(json.dumps({"measured_at": "2026-12-01T00:00:00Z",
                                                     "cases": [{"case": "burst", "ok": True}]}))
    benchdoc.write(root)
    (results / "faults.json").write_text(json.dumps({"measured_at": "2026-12-03T00:00:00Z",
                                                     "cases": [{"case": "burst", "ok": True}]}))
    benchdoc.write(root)
    (results / "faults.json").unlink()
    hand = root / "docs" / "benchmarks" / "notes.md"
    hand.write_text("# Notes by hand\n")
    assert benchdoc.check(root) == []
    found = benchdoc.pages(root)
    assert [p.file for p in found] == ["2026-12-03-faults.md", "2026-12-01-faults.md"]
    assert hand.read_text() == "# Notes by hand\n"


def test_benchdoc_needs_the_nav_markers(tmp_path: Path):
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nnav:\n  - Home: index.md\n")
    with pytest.raises(ValueError, match="no '# benchdoc: begin"):
        benchdoc.write(tmp_path)


def test_the_benchmark_index_and_nav_match_the_committed_pages():
    found = benchdoc.pages(REPO)
    assert (REPO / benchdoc.INDEX).read_text() == benchdoc.render_index(found)
    mkdocs = (REPO / "mkdocs.yml").read_text()
    assert benchdoc.render_nav(found, mkdocs) == mkdocs
