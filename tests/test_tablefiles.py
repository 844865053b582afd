"""The version tables folder (serve.store.tablefiles): streamed writes, mapped and pread reads."""
from __future__ import annotations

import json
from collections import namedtuple

import numpy as np
import pytest

from serve.errors import ArtifactError, ConfigError
from serve.store.tablefiles import MANIFEST_NAME, TableFiles, TableWriter, tables_folder_bytes

Spec = namedtuple("Spec", "name rows dim dtype")
SPECS = [Spec("t_user", 1000, 64, "int8"), Spec("t_item", 37, 32, "int8"),
         Spec("t_fp", 5, 8, "fp32"), Spec("t_empty", 0, 16, "int8")]


def _tables(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    from serve.rowformat import row_bytes
    return [rng.integers(0, 256, (s.rows, row_bytes(s.dtype, s.dim)), dtype=np.uint8)
            for s in SPECS]


def _write(folder, tables, chunk=64):
    with TableWriter(folder, SPECS) as w:
        for i, t in enumerate(tables):
            for start in range(0, t.shape[0], chunk):
                w.write(i, start, t[start : start + chunk])
        return w.commit()


def test_written_in_chunks_reads_back_exactly(tmp_path):
    tables = _tables()
    folder = tmp_path / "dlrm-v1.tables"
    manifest = _write(folder, tables)
    files = TableFiles.open(folder)
    try:
        assert [t.name for t in files.tables] == [s.name for s in SPECS]
        for i, t in enumerate(tables):
            assert np.array_equal(np.asarray(files.array(i)), t)
            if t.shape[0]:
                pick = np.array([0, t.shape[0] - 1, t.shape[0] // 2, 0], dtype=np.int64)
                assert np.array_equal(files.read_rows(i, pick), t[pick])
        assert files.verify() == []
        # disk is the table bytes plus a small manifest: no padding to the widest table
        assert files.nbytes == sum(t.nbytes for t in tables)
        assert tables_folder_bytes(folder) <= 1.01 * files.nbytes + 4096
        assert manifest.identity() == files.manifest.identity()
    finally:
        files.close()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_copy_on_write_never_reaches_the_file(tmp_path):
    tables = _tables()
    folder = tmp_path / "v.tables"
    _write(folder, tables)
    files = TableFiles.open(folder)
    a = files.array(0)
    a[3] = 7
    again = TableFiles.open(folder)
    assert np.array_equal(np.asarray(again.array(0))[3], tables[0][3])
    files.close()
    again.close()


def test_identity_differs_between_builds(tmp_path):
    m1 = _write(tmp_path / "a.tables", _tables(0))
    m2 = _write(tmp_path / "b.tables", _tables(1))
    assert m1.identity() != m2.identity()


def test_incomplete_or_out_of_order_writes_leave_nothing(tmp_path):
    tables = _tables()
    folder = tmp_path / "v.tables"
    w = TableWriter(folder, SPECS)
    with pytest.raises(ArtifactError, match="do not follow"):
        w.write(0, 10, tables[0][10:20])
    with pytest.raises(ArtifactError, match=r"uint8 \(n, 68\)"):
        w.write(0, 0, tables[0][:, :10])
    w.write(0, 0, tables[0][:10])
    with pytest.raises(ArtifactError, match="incomplete"):
        w.commit()
    assert not folder.exists() and not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError), TableWriter(folder, SPECS) as w2:
        w2.write(0, 0, tables[0][:5])
        raise RuntimeError("the import failed")
    assert not list(tmp_path.iterdir())


def test_existing_folder_is_refused(tmp_path):
    folder = tmp_path / "v.tables"
    _write(folder, _tables())
    with pytest.raises(ConfigError, match="written once"):
        TableWriter(folder, SPECS)


def test_damaged_folders_are_named(tmp_path):
    folder = tmp_path / "v.tables"
    _write(folder, _tables())
    with open(folder / "t001.rows", "ab") as f:
        f.write(b"x")
    with pytest.raises(ArtifactError, match="damaged"):
        TableFiles.open(folder)
    (folder / MANIFEST_NAME).write_text(json.dumps({"format": 9, "tables": []}))
    with pytest.raises(ArtifactError, match="format 9"):
        TableFiles.open(folder)
    (folder / MANIFEST_NAME).unlink()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        TableFiles.open(folder)


def test_flipped_byte_is_found_by_verify(tmp_path):
    folder = tmp_path / "v.tables"
    _write(folder, _tables())
    path = folder / "t000.rows"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    files = TableFiles.open(folder)
    assert files.verify() == [f"t_user ({path})"]
    with pytest.raises(ArtifactError, match="rows must be in"):
        files.read_rows(0, np.array([1000]))
    files.close()
