"""What a version switch asks the repository before anything is copied or loaded, with
a version's tables in a folder beside its archive (artifact format 3):

* a version (or a rollout's candidate) whose tables folder is missing is refused by the
  plan with a 400-style ``ConfigError`` naming the folder;
* the memory check sizes the new version by its table bytes (the manifest's) + archive,
  per worker, not by the archive alone, which no longer holds the tables.
"""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from serve.errors import ConfigError, InsufficientMemory
from serve.sidecar.adapters.memory import CgroupMemory, MemoryProbe
from serve.sidecar.adapters.torchserve import Observed
from serve.sidecar.control.switch import MemoryWatch, plan_switch
from serve.state import Batching, DesiredState, ModelRef, Rollout
from serve.store.repository import ModelRepository
from tests.test_repository import add, random_artifact

MiB = 1 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> ModelRepository:
    root = tmp_path_factory.mktemp("switch")
    repo = ModelRepository([root / "repo"])
    add(repo, "v1", random_artifact(seed=0), root / "work")
    add(repo, "v2", random_artifact(rows=4000, seed=1), root / "work",
        created="2026-12-02T00:00:00+00:00")
    return repo


def desired(version: str, workers: int = 2, candidate: str | None = None) -> DesiredState:
    return DesiredState(model=ModelRef(version=version),
                        batching=Batching(batch_size=8, max_batch_delay_ms=5), workers=workers,
                        rollout=(Rollout(candidate=candidate, weight=0.5) if candidate else None))


def plan(repo: ModelRepository, d: DesiredState, store: Path):
    p = plan_switch(Observed(default=None), d, repo, store=store, model="dlrm")
    assert p is not None
    return p


def probe(root: Path, limit: int, current: int) -> MemoryProbe:
    root.mkdir(parents=True, exist_ok=True)
    (root / "memory.max").write_text(f"{limit}\n")
    (root / "memory.current").write_text(f"{current}\n")
    return MemoryProbe(CgroupMemory(root), rss=lambda pid: None)


def test_the_plan_carries_the_table_bytes_of_the_version_and_the_candidate(
        repo: ModelRepository, tmp_path: Path) -> None:
    t1, t2 = repo.table_bytes("v1"), repo.table_bytes("v2")
    assert (t1, t2) == (26 * 2000 * 20, 26 * 4000 * 20)
    assert plan(repo, desired("v1"), tmp_path).table_bytes == t1
    assert plan(repo, desired("v1", candidate="v2"), tmp_path).table_bytes == t1 + t2


def test_the_memory_floor_is_the_mapped_tables_once_plus_archive_per_worker(
        repo: ModelRepository, tmp_path: Path) -> None:
    """Nothing serves yet (no RSS to go by), no host budget: the workers map the tables
    (the page cache holds them once for the pod): need = tables + archive x workers. A
    limit that the archives alone would fit (as the old rule sized them) but the tables
    do not is refused, naming the tables."""
    p = plan(repo, desired("v2", workers=2), tmp_path)
    archive = repo.archive("v2").stat().st_size
    need = p.table_bytes + archive * 2
    fits = probe(tmp_path / "a", limit=100 * MiB, current=10 * MiB)
    check = asyncio.run(MemoryWatch(fits).check(p, Observed(default=None), 0.9))
    assert check is not None and check.need_bytes == need
    assert check.need_basis == ("tables 2 MiB mapped once per pod + archive 0 MiB, "
                                "2 workers")
    tight = probe(tmp_path / "b", limit=int((10 * MiB + 2 * archive) / 0.9) + MiB,
                  current=10 * MiB)
    with pytest.raises(InsufficientMemory, match=r"needs about 2 MiB \(tables 2 MiB mapped "
                       r"once per pod") as info:
        asyncio.run(MemoryWatch(tight).check(p, Observed(default=None), 0.9))
    assert info.value.status == 507


def test_with_a_host_budget_the_floor_is_each_workers_tier(repo: ModelRepository,
                                                           tmp_path: Path) -> None:
    """With the workers' host budget (DLRM_HOST_CACHE_*), a pod smaller than its tables
    fits: each worker holds its tier (slots of the widest row + 16 B, and 4 B per table
    row for the row map), not the tables."""
    from serve.sidecar.adapters.memory import table_memory

    p = plan(repo, desired("v2", workers=2), tmp_path)
    (m,) = p.tables
    rows, rb = sum(t.rows for t in m.tables), max(t.row_bytes for t in m.tables)
    archive = repo.archive("v2").stat().st_size
    tm = table_memory(m.nbytes, rows, rb, host_bytes=None, host_fraction=0.1)
    assert tm.per_pod == 0
    assert tm.per_worker == (int(0.1 * m.nbytes) // rb) * (rb + 16) + 4 * rows
    limit = int((10 * MiB + 2 * (tm.per_worker + archive)) / 0.9) + 1
    fits = probe(tmp_path / "c", limit=limit, current=10 * MiB)
    check = asyncio.run(MemoryWatch(fits).check(p, Observed(default=None), 0.9,
                                                (None, 0.1)))
    assert check is not None and check.need_bytes == 2 * (tm.per_worker + archive)
    assert "host tier" in check.need_basis and "per worker" in check.need_basis
    assert table_memory(m.nbytes, rows, rb, host_bytes=0, host_fraction=None).per_worker \
        == 4 * rows


def test_a_version_without_its_tables_folder_is_refused_before_anything_loads(
        repo: ModelRepository, tmp_path: Path) -> None:
    root = repo.roots[0]
    aside = tmp_path / "aside.tables"
    shutil.move(root / "dlrm-v2.tables", aside)
    try:
        for d in (desired("v2"), desired("v1", candidate="v2")):
            with pytest.raises(ConfigError, match="references the tables folder "
                               "dlrm-v2.tables, which is in none") as info:
                plan_switch(Observed(default=None), d, repo, store=tmp_path / "store",
                            model="dlrm")
            assert info.value.status == 400
        assert not (tmp_path / "store").exists()   # nothing was written
    finally:
        shutil.move(aside, root / "dlrm-v2.tables")
    assert plan(repo, desired("v2"), tmp_path).table_bytes == repo.table_bytes("v2")
