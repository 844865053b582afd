"""Archives the sidecar derives (``rewrite_mar``) from versions whose tables are stored
once beside their archive (artifact format 3): a batching change or a rollout writes a
new archive of the dense part only, never a copy of the tables, and a rollout's candidate
artifact, packed inside the stable's archive, still resolves to the candidate's own
tables folder in the repository.

The bound: a derived archive is at most its source archive (+ the candidate's artifact
in a rollout) + 64 KiB (the rewritten manifest, config and the pod's handler), and under
a tenth of the bytes of the tables it serves (26 x 2000 rows x 20 B = 1.04 MB per version
here, the stable's + the candidate's in a rollout; a real model's tables are 10^1-10^4 x
its archive: small profile 55 MB vs 1.9 MB).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from serve.constants import ARTIFACT_NAME, CANDIDATE_ARTIFACT
from serve.runtime.artifact import Artifact, load_artifact
from serve.sidecar.adapters.archives import CandidateArchive, rewrite_mar
from serve.store.repository import ModelRepository, table_reference
from tests.test_repository import add, random_artifact

SLACK = 64 * 1024


@pytest.fixture(scope="module")
def arts() -> tuple[Artifact, Artifact]:
    return random_artifact(seed=0), random_artifact(seed=1)


@pytest.fixture
def repo(tmp_path: Path, arts: tuple[Artifact, Artifact]) -> ModelRepository:
    repo = ModelRepository([tmp_path / "repo"])
    add(repo, "v1", arts[0], tmp_path / "work")
    add(repo, "v2", arts[1], tmp_path / "work", created="2026-12-02T00:00:00+00:00")
    return repo


@pytest.fixture(autouse=True)
def _store(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()   # TorchServe's model store (the switch makes it)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_batching_archive_is_the_dense_part_only(tmp_path: Path,
                                                   repo: ModelRepository) -> None:
    before = _tree(repo.roots[0])
    src = repo.archive("v1")
    table_bytes = repo.table_bytes("v1")
    assert table_bytes is not None
    dst = rewrite_mar(src, tmp_path / "store" / "dlrm-v1_b8d5w2.mar", version="v1_b8d5w2",
                      batch_size=8, max_batch_delay_ms=5, workers=2)
    size = dst.stat().st_size
    assert size <= src.stat().st_size + SLACK and size < table_bytes / 10, (size, table_bytes)
    with zipfile.ZipFile(dst) as z:
        assert not [n for n in z.namelist() if ".tables" in n or n.endswith(".rows")]
    ref = table_reference(dst)
    assert ref is not None and ref == table_reference(src)   # the same folder, same build
    assert _tree(repo.roots[0]) == before   # the repository untouched: nothing copied


def test_a_rollout_archive_packs_the_candidates_reference_not_its_tables(
        tmp_path: Path, repo: ModelRepository, arts: tuple[Artifact, Artifact]) -> None:
    """The candidate's artifact inside the stable's archive names ``dlrm-v2.tables`` and
    loads, as the worker loads it (its search path: the repository folders), the
    candidate's own rows."""
    before = _tree(repo.roots[0])
    src, cand = repo.archive("v1"), repo.archive("v2")
    dst = rewrite_mar(src, tmp_path / "store" / "dlrm-v1_b8d5w2_cv2.mar",
                      version="v1_b8d5w2_cv2", batch_size=8, max_batch_delay_ms=5, workers=2,
                      candidate=CandidateArchive("v2", cand, tmp_path / "store" / "c.json"))
    with zipfile.ZipFile(cand) as z:
        cand_artifact = z.getinfo(ARTIFACT_NAME).file_size
    assert dst.stat().st_size <= src.stat().st_size + cand_artifact + SLACK
    served = (repo.table_bytes("v1") or 0) + (repo.table_bytes("v2") or 0)
    assert dst.stat().st_size < served / 10, (dst.stat().st_size, served)
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(dst) as z:
        assert not [n for n in z.namelist() if ".tables" in n]
        z.extractall(unpacked)
    for name, version, art in ((ARTIFACT_NAME, "v1", arts[0]),
                               (CANDIDATE_ARTIFACT, "v2", arts[1])):
        loaded = load_artifact(unpacked / name, tables_path=repo.roots)
        try:
            assert loaded.files is not None
            assert loaded.files.folder == repo.roots[0] / f"dlrm-{version}.tables"
            for a, b in zip(loaded.tables, art.tables, strict=True):
                assert torch.equal(torch.as_tensor(a.data), b.data), (version, a.name)
        finally:
            loaded.files.close()
    assert _tree(repo.roots[0]) == before
