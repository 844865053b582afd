"""Local runtime files (security review N9): what holds tables, embedding deltas, request
ids, scores and tokens is created 0600 in 0700 folders whatever the umask, and a token
file other users can read is used with a loud warning.

The unit tests run each writer under the usual umask 022; the integration test starts
the real service (launcher, TorchServe, sidecar), answers a predict (so the prediction
log and the shared tables exist) and lists every file under its run folder that other
users could read: only :data:`DOCUMENTED` may be."""
from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.common.filemodes import private_dir, private_opener
from serve.runtime.shared import SharedTables
from serve.sidecar.adapters.tokens import ensure_dev_token, load_token
from serve.store.deltas.incoming import Incoming
from serve.store.predlog import Prediction, PredictionLogConfig, PredictionLogWriter

#: Files under the run folder that other users may read, and why that is harmless: the
#: launcher's record of its process ids (``make down`` reads it). The run folder itself
#: is 0700, so not even these are reachable by another user.
DOCUMENTED = {"pids.json"}


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_private_opener_creates_0600_and_narrows_an_existing_file(tmp_path: Path,
                                                                  umask_022: None) -> None:
    with open(tmp_path / "new", "wb", opener=private_opener) as f:
        f.write(b"x")
    assert mode(tmp_path / "new") == 0o600
    old = tmp_path / "old"
    old.write_bytes(b"y")
    assert mode(old) == 0o644
    with open(old, "ab", opener=private_opener) as f:
        f.write(b"z")
    assert mode(old) == 0o600 and old.read_bytes() == b"yz"
    folder = private_dir(tmp_path / "a" / "b")
    assert mode(folder) == 0o700
    existing = tmp_path / "mounted"
    existing.mkdir(mode=0o755)
    private_dir(existing)
    assert mode(existing) == 0o755  # a folder it did not create is left as it is


def test_shared_tables_and_their_locks_are_private(tmp_path: Path, umask_022: None) -> None:
    path = tmp_path / "deltas" / "v1" / "tables.bin"
    shared = SharedTables(path)
    table = shared.open([torch.zeros(4, 16, dtype=torch.uint8),
                         torch.ones(3, 16, dtype=torch.uint8)])
    assert tuple(table.shape) == (7, 16)
    shared.set_sequence(1)
    files = sorted(p.name for p in path.parent.iterdir())
    assert {"tables.bin", "tables.lock", "tables.turn", "tables.seq"} <= set(files), files
    assert {p.name: mode(p) for p in path.parent.iterdir()} == dict.fromkeys(files, 0o600)
    assert mode(path.parent) == 0o700


def test_the_prediction_log_is_private(tmp_path: Path, umask_022: None) -> None:
    folder = tmp_path / "run" / "predictions"
    writer = PredictionLogWriter(PredictionLogConfig(folder), pid=1)
    assert writer.write([Prediction("r1", "v1", "stable", 1.7e9,
                                    np.array([0.25], np.float32))]) == 1
    writer.close()
    [log] = list(folder.iterdir())
    assert (mode(folder), mode(log)) == (0o700, 0o600)


def test_an_incoming_delta_body_is_private(tmp_path: Path, umask_022: None) -> None:
    body = Incoming(tmp_path / ".incoming-2", max_bytes=1024)
    body.write(b"rows")
    assert mode(tmp_path / ".incoming-2") == 0o600
    body.discard()


def test_load_token_warns_loudly_on_a_file_others_can_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    token = tmp_path / "token"
    ensure_dev_token(token)
    assert mode(token) == 0o600
    load_token(token)
    token.chmod(0o440)  # Kubernetes' projected Secret with fsGroup: accepted quietly
    load_token(token)
    assert not caplog.records
    token.chmod(0o644)
    assert load_token(token) == token.read_text().strip()  # used, not refused
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"token file {token} has mode 0644: other users of this host can read it; make it "
        f"private with `chmod 600 {token}` (or the Secret's defaultMode 0400)")


# ------------------------------------------------------------------ the real service


@pytest.mark.integration
@pytest.mark.slow
def test_a_started_service_leaves_nothing_readable_by_others(
        tmp_path_factory: pytest.TempPathFactory, umask_022: None) -> None:
    from serve.api.binary import example_binary
    from serve.model.archive import build_mar
    from serve.store.repository import ModelRepository
    from tests.fixtures.served import serve_repository
    from tests.fixtures.torchserve import tiny_random_artifact

    root = tmp_path_factory.mktemp("modes")
    version = "tiny-modes"
    art = tiny_random_artifact(root / "artifact.pt", seed=3)
    mar = build_mar(art, root / "build", model_name="dlrm", version=version, batch_size=1,
                    max_batch_delay_ms=0, handler_config={"num_threads": 1},
                    min_workers=1, max_workers=1, file_name=f"{version}.mar")
    ModelRepository([root / "model_store"]).add(version, mar, {
        "version": version, "profile": "tiny", "quantized_dtype": "int8",
        "created_at": "2026-12-07T00:00:00+00:00"})
    with serve_repository(root, state={"model": {"version": version}, "workers": 1}) as s:
        assert len(s.predictions(example_binary(4, seed=1, max_id=100))) == 4
        run = s.cfg.path(s.cfg.run_dir)
        files = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink()]
        names = {p.relative_to(run).as_posix() for p in files}
        # what this test is about is there: the token, the prediction log, the tables
        assert "sidecar-token" in names
        assert any(n.startswith("predictions/") for n in names), sorted(names)
        assert any(n.endswith("tables.bin") for n in names), sorted(names)
        readable = sorted(p.relative_to(run).as_posix() for p in files
                          if mode(p) & 0o004 and p.name not in DOCUMENTED)
        assert readable == [], readable
        assert mode(run) == 0o700
