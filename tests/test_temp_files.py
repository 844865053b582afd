"""Temporary files in folders the model container shares (TorchServe's model store, the
delta folder): a symlink planted at the old predictable temp name (``<name>.tmp``,
``.<name>.<pid>.tmp``) must not be followed. Each writer creates its temp file with
``tempfile.mkstemp`` (``O_EXCL | O_NOFOLLOW``, a random name) via
:func:`serve.common.durable.temp_beside`, so the symlink's target stays untouched and the
file is still written (review N7)."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from serve.common.durable import temp_beside, write_durably
from serve.runtime.shared import SharedTables
from serve.sidecar.adapters.archives import rewrite_mar
from serve.sidecar.control.drain import closed_archive

VICTIM = b"a file the sidecar must never write\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the shared folder that a planted symlink points at."""
    p = tmp_path / "elsewhere" / "victim"
    p.parent.mkdir()
    p.write_bytes(VICTIM)
    return p


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def assert_untouched(link: Path, victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    assert link.is_symlink() and link.resolve() == victim.resolve()


def small_mar(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {
            "modelName": "dlrm", "handler": "h.py", "modelVersion": "1.0",
            "configFile": "model-config.yaml"}}))
        z.writestr("model-config.yaml", "batchSize: 1\n")
        z.writestr("h.py", "# handler\n")
    return path


def test_rewrite_mar_never_follows_a_symlink_at_its_old_temp_path(tmp_path, victim):
    store = tmp_path / "model-store"
    dst = store / "dlrm-v1_b8d5w2.mar"
    link = plant(dst.with_name(dst.name + ".tmp"), victim)
    out = rewrite_mar(small_mar(tmp_path / "repo" / "dlrm-v1.mar"), dst, version="v1_b8d5w2",
                      batch_size=8, max_batch_delay_ms=5, workers=2, handler_file=None)
    assert_untouched(link, victim)
    with zipfile.ZipFile(out) as z:
        assert json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["modelVersion"] == \
            "v1_b8d5w2"
    assert sorted(p.name for p in store.iterdir()) == sorted([link.name, dst.name])  # no temp left


def test_a_failed_rewrite_leaves_no_temp_file_and_the_symlink_alone(tmp_path, victim):
    store = tmp_path / "model-store"
    dst = store / "dlrm-v1.mar"
    link = plant(dst.with_name(dst.name + ".tmp"), victim)
    bad = tmp_path / "repo" / "bad.mar"
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("nothing", "")
    with pytest.raises(Exception, match="no MAR-INF/MANIFEST.json"):
        rewrite_mar(bad, dst, version="v1", batch_size=1, max_batch_delay_ms=1, workers=1,
                    handler_file=None)
    assert_untouched(link, victim)
    assert [p.name for p in store.iterdir()] == [link.name]


def test_the_closed_archive_never_follows_a_symlink_at_its_old_temp_path(tmp_path, victim):
    store = tmp_path / "model-store"
    handler = tmp_path / "closed_handler.py"
    handler.write_text("# closed\n")
    link = plant(store / "dlrm-closed.mar.tmp", victim)
    out = closed_archive(store, "dlrm", handler_file=handler)
    assert_untouched(link, victim)
    assert zipfile.is_zipfile(out)


def test_write_durably_never_follows_a_symlink_at_its_old_temp_path(tmp_path, victim):
    path = tmp_path / "deltas" / ".drained.json"
    link = plant(path.with_name(f".{path.name}.{os.getpid()}.tmp"), victim)
    write_durably(path, b'{"drained": true}')
    assert_untouched(link, victim)
    assert path.read_bytes() == b'{"drained": true}' and not path.is_symlink()


def test_shared_tables_sequence_and_identity_never_follow_a_planted_symlink(tmp_path, victim):
    tables = SharedTables(tmp_path / "deltas" / "v1" / "tables.bin")
    try:
        links = [plant(tmp_path / "deltas" / "v1" / f"tables.{k}.{os.getpid()}.tmp", victim)
                 for k in ("seq", "id")]
        with tables.write():
            tables.set_sequence(7)
        assert tables.sequence() == 7
        for link in links:
            assert_untouched(link, victim)
    finally:
        tables.close()


def test_temp_beside_is_exclusive_private_and_unpredictable(tmp_path):
    target = tmp_path / "f"
    (fd1, a), (fd2, b) = temp_beside(target), temp_beside(target)
    os.close(fd1)
    os.close(fd2)
    assert a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith(".f.") and a.name.endswith(".tmp")
    assert a.stat().st_mode & 0o777 == 0o600
