"""A version's tables stored once and mapped in place, over the real launcher, TorchServe
(2 workers) and the sidecar: a version added the one way versions are
(``add_version``: ``dlrm-<V>.tables/`` + a format-3 ``.mar`` + report), 26 tables x
20 000 rows x 20 B = 10.4 MB of tables beside a ~70 KB archive.

* HTTP predictions equal (``torch.equal``) the in-process Runtime over the same archive's
  artifact (its tables mapped from the same folder);
* no table bytes copied at load: TorchServe's unpack folder (its TMPDIR) holds no file
  as large as one table and less than a tenth of the tables in all, and no file in the
  run folder (unpack, deltas, metrics), nor in the model store outside the tables folder,
  holds the bytes of any table: a 4 KiB sample from the middle of each table file is
  searched for in every file. The runtime's shared ``tables.bin`` (written today when
  deltas are wired on CPU) is the one exception, neither required nor forbidden here;
* disk per version (tables folder + archive + report) <= 1.1 x the table bytes;
* a PUT /batching (a derived archive) grows the model store by the archive, not the
  tables, and the predictions stay equal.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from serve.api.binary import encode_binary
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.store.repository import ModelRepository, extract_artifact
from serve.store.tablefiles import MANIFEST_NAME, tables_folder_bytes
from tests.fixtures.served import Served, serve_repository
from tests.test_repository import add, random_artifact

pytestmark = [pytest.mark.integration]

VERSION = "tip-v1"
ROWS = 20_000
F = 26
SAMPLE = 4096
#: Files of the run folder that may hold a table copy today (serve/runtime/shared.py).
SHARED_COPY = "tables.bin"


@dataclass
class TablesServed(Served):
    repo: ModelRepository
    reference: Runtime

    @property
    def tables(self) -> Path:
        folder = self.repo.tables(VERSION)
        assert folder is not None
        return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TablesServed]:
    root = tmp_path_factory.mktemp("tables-in-place")
    repo = ModelRepository([root / "model_store"])
    add(repo, VERSION, random_artifact(rows=ROWS, seed=3), root / "work")
    reference = Runtime.from_artifact(extract_artifact(repo.archive(VERSION), root / "ref"),
                                      RuntimeConfig())
    state = {"model": {"version": VERSION},
             "batching": {"batch_size": 2, "max_batch_delay_ms": 2}, "workers": 2}
    with serve_repository(root, state=state, kind=TablesServed,
                          fields={"repo": repo, "reference": reference}) as s:
        yield s


def _batch(seed: int, b: int = 16) -> tuple[bytes, torch.Tensor, SparseBatch]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (F, b), generator=g, dtype=torch.int32)
    values = torch.randint(0, 2 * ROWS, (int(lengths.sum()),), generator=g)  # modulo too
    dense = torch.randn(b, 13, generator=g)
    body = encode_binary(dense.numpy().astype(np.float32), lengths.numpy(), values.numpy())
    return body, dense, SparseBatch(values, lengths)


def _assert_equal_predictions(s: TablesServed, seeds: range) -> None:
    for seed in seeds:
        body, dense, sparse = _batch(seed)
        got = torch.tensor(s.predictions(body), dtype=torch.float32)
        assert torch.equal(got, s.reference.predict(dense, sparse)), seed


def _files(*roots: Path) -> list[Path]:
    return sorted({p for r in roots if r.exists() for p in r.rglob("*")
                   if p.is_file() and not p.is_symlink()})


def test_http_predictions_equal_the_in_process_runtime(served: TablesServed) -> None:
    _assert_equal_predictions(served, range(12))


def test_no_table_bytes_are_copied_at_load(served: TablesServed) -> None:
    entries = served.repo.table_bytes(VERSION)
    assert entries == F * ROWS * 20
    table_files = sorted(served.tables.glob("t*.rows"))
    smallest_table = min(p.stat().st_size for p in table_files)
    # TorchServe's unpack folder: the archive's few files, nothing near a table.
    unpack = _files(served.cfg.path(served.cfg.run_dir) / "torchserve" / "tmp")
    sizes = [p.stat().st_size for p in unpack]
    assert unpack and max(sizes) < smallest_table and sum(sizes) < entries / 10, \
        (max(sizes), sum(sizes), entries)
    # No file anywhere in the run folder or the model store (outside the tables folder)
    # holds a table's bytes; the sample search finds them where they are.
    samples = []
    for p in table_files:
        with open(p, "rb") as f:
            f.seek(p.stat().st_size // 2)
            samples.append(f.read(SAMPLE))
    assert all(s in p.read_bytes() for s, p in zip(samples, table_files, strict=True))
    run_dir = served.cfg.path(served.cfg.run_dir)
    scanned, copies, shared = 0, [], []
    for p in _files(run_dir, served.cfg.delta_dir, served.cfg.path(served.cfg.model_store)):
        if served.tables in p.parents:
            continue
        scanned += 1
        if any(s in p.read_bytes() for s in samples):
            (shared if p.name == SHARED_COPY else copies).append(p)
    assert scanned > 10 and copies == [], copies
    print(f"\nunpack dir: {len(unpack)} files, largest {max(sizes)} B, total {sum(sizes)} B; "
          f"tables {entries} B (largest table file {max(p.stat().st_size for p in table_files)}"
          f" B); scanned {scanned} files, table copies {len(copies)}, shared {SHARED_COPY}: "
          f"{len(shared)}")


def test_disk_per_version_is_at_most_1_1_x_its_tables(served: TablesServed) -> None:
    root = served.repo.roots[0]
    entries = served.repo.table_bytes(VERSION)
    assert entries is not None
    disk = (tables_folder_bytes(served.tables) + served.repo.archive(VERSION).stat().st_size
            + (root / f"dlrm-{VERSION}.json").stat().st_size)
    assert (served.tables / MANIFEST_NAME).is_file()
    assert disk <= 1.1 * entries, (disk, entries)
    print(f"\ndisk per version {disk} B = {disk / entries:.3f} x the table bytes {entries} B")


def test_a_batching_change_grows_the_store_by_an_archive_not_the_tables(
        served: TablesServed) -> None:
    store = served.cfg.path(served.cfg.model_store)

    def usage() -> int:
        return sum(p.stat().st_size for p in _files(store))

    before, folders = usage(), sorted(p.name for p in store.glob("*.tables"))
    r = httpx.put(f"{served.write_url}/batching",
                  json={"batch_size": 4, "max_batch_delay_ms": 3},
                  headers={"Authorization": f"Bearer {served.token}"}, timeout=180)
    assert r.status_code == 200, r.text
    served.client.wait_converged(timeout_s=120)
    grown = usage() - before
    derived = [p for p in store.glob("dlrm-*_*.mar")]
    assert derived and all(p.stat().st_size < (served.repo.table_bytes(VERSION) or 0) / 10
                           for p in derived)
    assert sorted(p.name for p in store.glob("*.tables")) == folders
    assert abs(grown) < 1 << 20, grown
    _assert_equal_predictions(served, range(100, 104))
    print(f"\nPUT /batching: model store {before} -> {before + grown} B ({grown:+d} B); "
          f"derived archives {[(p.name, p.stat().st_size) for p in derived]}")
    assert os.path.isdir(served.tables)
