"""The model repository with a version's tables stored once, beside its archive
(``<model>-<version>.tables/``, artifact format 3): the reference read without torch,
the check a switch makes before anything loads, the table bytes, removal, extraction for
in-process reads; ``versions()`` as before.

Versions here are real ones (``serve.model.archive.add_version`` over a random tiny-shaped
artifact, no training: a second each).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu_check import build_random_artifact
from serve.errors import ConfigError
from serve.profiles import NUM_DENSE
from serve.runtime.artifact import (
    Artifact,
    QuantTable,
    load_artifact,
    quantize_rows_reference,
    save_artifact,
)
from serve.store.repository import (
    ModelRepository,
    extract_artifact,
    table_reference,
)
from serve.store.tablefiles import MANIFEST_NAME, tables_folder_bytes
from tests.fixtures.sidecar import toy_mar

ROWS = 2000


def random_artifact(rows: int = ROWS, seed: int = 0) -> Artifact:
    """The tiny profile's 26 features and dense layers (random) over int8 tables of
    ``rows`` rows each: tables that dominate the archive, as a real model's do."""
    base = build_random_artifact("tiny", torch.device("cpu"), seed=seed)
    g = torch.Generator().manual_seed(seed)
    tables = [QuantTable(t.name, rows, t.dim, t.dtype,
                         quantize_rows_reference((torch.rand((rows, t.dim), generator=g) - 0.5)
                                                 * 0.1, "int8"))
              for t in base.tables]
    dense = base.dense
    return Artifact.dlrm(base.feature_names, NUM_DENSE, "int8", tables,
                         dense.dense_arch, dense.over_arch,  # type: ignore[union-attr]
                         {"origin": "tests random", "seed": seed})


def report(version: str, created: str = "2026-12-01T00:00:00+00:00") -> dict[str, Any]:
    return {"version": version, "created_at": created, "profile": "tiny",
            "quantized_dtype": "int8", "mar_batch_size": 2, "mar_max_batch_delay_ms": 2,
            "mar_workers": 1}


def add(repo: ModelRepository, version: str, art: Artifact, work: Path,
        created: str = "2026-12-01T00:00:00+00:00") -> Path:
    """``version`` added the one way versions are (``add_version``: tables folder,
    format-3 archive, report)."""
    from serve.model.archive import add_version

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{version}.pt"
    save_artifact(art, path)
    try:
        return add_version(repo, path, version, report(version, created), work,
                           batch_size=2, max_batch_delay_ms=2, workers=1,
                           handler_config={"num_threads": 1})
    finally:
        path.unlink()


@pytest.fixture(scope="module")
def art() -> Artifact:
    return random_artifact()


@pytest.fixture
def repo(tmp_path: Path, art: Artifact) -> ModelRepository:
    repo = ModelRepository([tmp_path / "store"])
    add(repo, "v1", art, tmp_path / "work")
    return repo


def test_a_version_is_its_tables_folder_archive_and_report(repo: ModelRepository,
                                                           art: Artifact) -> None:
    root = repo.roots[0]
    assert sorted(p.name for p in root.iterdir()) == [
        "dlrm-v1.json", "dlrm-v1.mar", "dlrm-v1.mar.sha256", "dlrm-v1.tables"]
    assert repo.versions() == ["v1"]
    assert repo.tables("v1") == root / "dlrm-v1.tables"
    table_bytes = sum(int(t.data.numel()) for t in art.tables)
    assert repo.table_bytes("v1") == table_bytes
    # The archive carries no table bytes: its artifact references the folder.
    ref = table_reference(repo.archive("v1"))
    assert ref is not None and ref.folder == "dlrm-v1.tables"
    manifest = json.loads((root / "dlrm-v1.tables" / MANIFEST_NAME).read_text())
    assert len(manifest["tables"]) == 26
    assert repo.archive("v1").stat().st_size < table_bytes / 10
    assert repo.check_tables("v1") == root / "dlrm-v1.tables"


def test_table_reference_reads_no_torch_and_none_for_archives_holding_their_tables(
        tmp_path: Path, repo: ModelRepository, art: Artifact) -> None:
    """In a fresh interpreter: the reference is read and torch never imported (the
    sidecar's pod code does not load torch for it); a format-2 archive, a toy one and a
    non-torch artifact give None."""
    code = ("import sys; from serve.store.repository import table_reference; "
            f"r = table_reference({str(repo.archive('v1'))!r}); "
            "print(r.folder, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                       text=True, check=True, cwd=Path(__file__).parents[1],
                                       env={**os.environ, "PYTHONPATH": str(Path(__file__)
                                                                            .parents[1])})
    assert out.stdout.split() == ["dlrm-v1.tables", "False"]
    from serve.model.archive import build_mar

    inline = tmp_path / "inline.pt"
    save_artifact(art, inline)   # in memory: format 2, the tables in the file
    mar = build_mar(inline, tmp_path / "inline", model_name="dlrm", version="x",
                    batch_size=2, max_batch_delay_ms=2)
    assert table_reference(mar) is None
    assert table_reference(toy_mar(tmp_path / "toy.mar")) is None
    (tmp_path / "junk.mar").write_bytes(b"not a zip")   # the copy step reports it
    assert table_reference(tmp_path / "junk.mar") is None


def test_check_tables_refuses_a_version_whose_folder_is_missing_or_damaged(
        tmp_path: Path, repo: ModelRepository) -> None:
    root = repo.roots[0]
    folder = root / "dlrm-v1.tables"
    moved = tmp_path / "elsewhere.tables"
    shutil.move(folder, moved)
    assert repo.versions() == ["v1"]   # listed as before: the report and the archive are there
    with pytest.raises(ConfigError) as info:
        repo.check_tables("v1")
    msg = info.value.message
    assert "references the tables folder dlrm-v1.tables" in msg and str(root) in msg
    assert "copy the version's dlrm-v1.tables/" in msg and info.value.status == 400
    # Incomplete: a file shorter than its manifest says (a copy cut short).
    shutil.copytree(moved, folder)
    t0 = folder / "t000.rows"
    os.chmod(t0, 0o644)
    with open(t0, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"t000.rows is 10 bytes"):
        repo.check_tables("v1")


def test_check_tables_refuses_another_builds_tables(tmp_path: Path,
                                                    repo: ModelRepository) -> None:
    """v2's tables copied under v1's name: the identity the archive was made with differs."""
    other = ModelRepository([tmp_path / "other"])
    add(other, "v1", random_artifact(seed=1), tmp_path / "work2")
    folder = repo.roots[0] / "dlrm-v1.tables"
    shutil.rmtree(folder)
    shutil.copytree(other.roots[0] / "dlrm-v1.tables", folder)
    with pytest.raises(ConfigError, match="holds another build"):
        repo.check_tables("v1")


def test_tables_are_found_in_any_repository_folder_in_the_workers_order(
        tmp_path: Path, repo: ModelRepository) -> None:
    """The sidecar looks where the workers look (DLRM_REPOSITORY: every folder, in order)."""
    second = tmp_path / "second"
    second.mkdir()
    shutil.move(repo.roots[0] / "dlrm-v1.tables", second / "dlrm-v1.tables")
    both = ModelRepository([repo.roots[0], second])
    assert both.check_tables("v1") == second / "dlrm-v1.tables"
    assert both.table_bytes("v1") == 26 * ROWS * 20
    assert repo.table_bytes("v1") is None   # the first folder alone holds no tables now
    with pytest.raises(ConfigError):
        repo.check_tables("v1")


def test_check_tables_passes_archives_that_hold_their_tables(tmp_path: Path) -> None:
    repo = ModelRepository([tmp_path / "store"])
    src = toy_mar(tmp_path / "toy.mar")
    repo.add("old", src, report("old"))
    assert repo.check_tables("old") is None and repo.table_bytes("old") is None
    with pytest.raises(ConfigError, match="not in the repository"):
        repo.check_tables("nope")


def test_remove_deletes_report_archive_and_tables(tmp_path: Path, repo: ModelRepository,
                                                  art: Artifact) -> None:
    add(repo, "v2", art, tmp_path / "work", created="2026-12-02T00:00:00+00:00")
    assert repo.versions() == ["v1", "v2"]
    repo.remove("v1")
    assert repo.versions() == ["v2"]
    assert sorted(p.name for p in repo.roots[0].iterdir()) == [
        "dlrm-v2.json", "dlrm-v2.mar", "dlrm-v2.mar.sha256", "dlrm-v2.tables"]
    with pytest.raises(ConfigError):
        repo.remove("v1")


def test_disk_per_version_is_its_table_bytes_plus_a_small_archive(repo: ModelRepository) -> None:
    """Tables 26 x 2000 rows x 20 B = 1.04 MB; the archive is the dense part (~40 KB)."""
    root = repo.roots[0]
    table_bytes = repo.table_bytes("v1")
    assert table_bytes is not None
    disk = (tables_folder_bytes(root / "dlrm-v1.tables") + (root / "dlrm-v1.mar").stat().st_size
            + (root / "dlrm-v1.json").stat().st_size)
    assert disk <= 1.1 * table_bytes, (disk, table_bytes)


def test_extract_artifact_links_the_tables_folder_and_loads_without_the_env(
        tmp_path: Path, repo: ModelRepository, art: Artifact,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLRM_REPOSITORY", raising=False)
    path = extract_artifact(repo.archive("v1"), tmp_path / "x")
    link = tmp_path / "x" / "dlrm-v1.tables"
    assert link.is_symlink() and link.resolve() == (repo.roots[0] / "dlrm-v1.tables").resolve()
    loaded = load_artifact(path)
    try:
        assert loaded.files is not None
        for a, b in zip(loaded.tables, art.tables, strict=True):
            assert torch.equal(torch.as_tensor(a.data), b.data)
    finally:
        loaded.files.close()
    with zipfile.ZipFile(repo.archive("v1")) as z:
        assert {i.filename for i in z.infolist()} >= {"artifact.pt"}
        assert not [i for i in z.infolist() if ".tables" in i.filename]
    with pytest.raises(ConfigError, match="in none of"):
        extract_artifact(repo.archive("v1"), tmp_path / "y", roots=[tmp_path / "nowhere"])


def test_adding_another_repositorys_archive_links_its_tables_in(tmp_path: Path,
                                                                repo: ModelRepository) -> None:
    """``add(version, archive, report)`` of a format-3 archive brings its tables folder
    from beside it, hard-linked (same inodes: no byte copied); added again under another
    name, the copy shares the folder its archive references (no second link set)."""
    other = ModelRepository([tmp_path / "other"])
    other.add("v1", repo.archive("v1"), report("v1"))
    src, dst = repo.roots[0] / "dlrm-v1.tables", other.roots[0] / "dlrm-v1.tables"
    assert other.check_tables("v1") == dst
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())
    assert all((dst / p.name).stat().st_ino == p.stat().st_ino for p in src.iterdir())
    other.add("v9", repo.archive("v1"), report("v9"))
    assert set(other.versions()) == {"v1", "v9"}
    assert other.tables("v9") == dst == other.check_tables("v9")
    assert not (other.roots[0] / "dlrm-v9.tables").exists()
