"""Embedding deltas and the sidecar's own files that survive crashes and restarts: a
re-post of the same bytes is stored once, a damaged stored delta is named and repaired, a
2 GiB file on the model volume is skipped without touching readiness, the delta folder
keeps only what is served, writes are fsynced, and a drained pod stays drained across a
sidecar restart. The real sidecar app under uvicorn with the fake TorchServe management
API of tests/test_deltas_sidecar.py (TorchServe is not what is tested here)."""
from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from serve.common.durable import write_durably
from serve.common.net import wait_until
from serve.sidecar.control.state_file import DesiredStateFile
from serve.state import DesiredState, ModelRef
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import decode_delta
from tests.fixtures.deltas import store_delta
from tests.promtext import samples
from tests.test_deltas_sidecar import AUTH, OTHER, SERVED, make_delta, post, start_pod, status


def _apply_all(pod, version: str, sequence: int) -> None:  # type: ignore[no-untyped-def]
    """What the live workers write once they applied ``sequence``."""
    for pid in pod.pids():
        pod.store.write_worker_status(status(pid, sequence, version=version))


def test_fsync_of_the_file_and_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """The delta store, the desired-state file and the drain marker fsync the file, then
    rename, then fsync the folder (a crash leaves the old or the new file, whole)."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    blob = make_delta(1)
    final = store_delta(DeltaStore(tmp_path / "deltas"), blob, decode_delta(blob))
    assert any(".incoming." in p for p in synced)          # the body, before the rename
    assert str(final.parent) in synced and str(tmp_path / "deltas") in synced
    synced.clear()
    state = tmp_path / "state" / "state.yaml"
    DesiredStateFile(state).write(DesiredState(model=ModelRef(version=SERVED)))
    assert synced[0].startswith(str(state.parent / ".state.yaml.")) and synced[1] == str(
        state.parent)
    synced.clear()
    write_durably(tmp_path / ".drained.json", b"{}")
    assert len(synced) == 2 and synced[1] == str(tmp_path)


def test_the_same_bytes_again_are_200_and_stored_once(tmp_path: Path) -> None:
    pod = start_pod(tmp_path)
    try:
        body = make_delta(1)
        _apply_all(pod, SERVED, 1)  # the workers have it applied already
        with pod.client() as c:
            first = post(c, body, wait_s=5)
            again = post(c, body, wait_s=5)
        assert first.status_code == 200 and again.status_code == 200, again.text
        assert "already stored with the same bytes (kept once)" in again.json()["message"]
        folder = pod.store.folder(SERVED)
        assert sorted(p.name for p in folder.iterdir() if p.is_file()) == ["00000001.delta"]
        assert (folder / "00000001.delta").read_bytes() == body
    finally:
        pod.stop()


def test_a_truncated_stored_delta_is_named_and_a_repost_repairs_it(tmp_path: Path) -> None:
    pod = start_pod(tmp_path)
    try:
        body = make_delta(1)
        with pod.client() as c:
            assert post(c, body).status_code == 202
            stored = pod.store.path(SERVED, 1)
            with open(stored, "r+b") as f:      # a crash mid-write, a bad disk
                f.truncate(len(body) - 7)
            (damaged,) = c.get("/embeddings/deltas").json()["damaged"]
            assert damaged["version"] == SERVED and damaged["file"] == "00000001.delta"
            assert damaged["reason"].startswith("payload: ")
            assert "the file is truncated or padded" in damaged["reason"]
            _apply_all(pod, SERVED, 1)  # the workers apply it once it reads whole
            r = post(c, body, wait_s=5)
            assert r.status_code == 200, r.text
            assert "in place of the damaged file" in r.json()["message"]
            assert c.get("/embeddings/deltas").json()["damaged"] == []
        assert stored.read_bytes() == body
    finally:
        pod.stop()


def test_a_2_gib_file_on_the_volume_is_skipped_once_and_readiness_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sparse 2 GiB ``...00000001.delta`` on the model volume: never read (stat first),
    one log line and one count however many sync passes see it; /readyz stays 200 and
    the sidecar keeps running."""
    volume = tmp_path / "repo" / "deltas" / SERVED
    volume.mkdir(parents=True)
    big = volume / f"dlrm-{SERVED}-00000001.delta"
    subprocess.run(["truncate", "-s", "2G", str(big)], check=True)
    caplog.set_level(logging.ERROR, logger="serve.sidecar.services.deltas.volume")
    pod = start_pod(tmp_path, delta_sync_s=0.05)
    try:
        with pod.client() as c:
            def skipped() -> float:
                m = samples(c.get("/metrics").text)
                return m.get(("dlrm_delta_files_skipped_total", (("reason", "too_large"),)), 0)
            wait_until(lambda: skipped() == 1, timeout_s=20, what="the skip counted",
                       interval_s=0.05)
            wait_until(lambda: c.get("/readyz").status_code == 200, timeout_s=20,
                       what="/readyz 200", interval_s=0.05)
            time.sleep(0.5)  # ten more sync passes: still one line, one count
            assert skipped() == 1 and c.get("/readyz").status_code == 200
            assert c.get("/healthz").status_code == 200
        lines = [r for r in caplog.records if "not taken (too_large)" in r.getMessage()]
        assert len(lines) == 1 and "2147483648 bytes is over the" in lines[0].getMessage()
        assert pod.store.sequences(SERVED) == []
    finally:
        pod.stop()


def _put_state(c: httpx.Client, version: str, batch: int) -> None:
    body = {"model": {"version": version}, "batching": {"batch_size": batch,
                                                         "max_batch_delay_ms": 50},
            "workers": 2}
    r = c.put("/state", json=body, headers=AUTH)
    assert r.status_code in (200, 202), r.text


def test_four_switches_leave_only_the_served_versions_files(tmp_path: Path) -> None:
    """Each served version gets a delta and a shared table; after each of four switches
    (a -> b -> a -> b -> a) the delta folder holds the served version's folder only."""
    pod = start_pod(tmp_path, delta_sync_s=0.05)
    versions = [SERVED, OTHER, SERVED, OTHER, SERVED]
    try:
        with pod.client() as c:
            for i, version in enumerate(versions):
                if i:
                    _put_state(c, version, 8 + i)
                    wait_until(lambda: c.get("/state").json()["converged"], timeout_s=30,
                               what=f"switch {i} converged", interval_s=0.05)
                folder = pod.store.folder(version)
                _apply_all(pod, version, 0)
                (folder / "tables.bin").write_bytes(b"\0" * 4096)  # what the workers map
                assert post(c, make_delta(1, version=version)).status_code == 202
                root = pod.delta_dir
                assert root is not None

                def only(root: Path = root, version: str = version) -> bool:
                    return sorted(p.name for p in root.iterdir()
                                  if not p.name.startswith(".")) == [version]

                wait_until(only, timeout_s=20, what=f"only {version} left", interval_s=0.05)
                assert sorted(p.name for p in folder.iterdir()) == [
                    "00000001.delta", "tables.bin", "workers"]
    finally:
        pod.stop()


def test_a_drained_pod_stays_drained_after_a_sidecar_restart(tmp_path: Path) -> None:
    """POST /drain records the drain (default: <delta dir>/.drained.json); a sidecar
    restarted on that file answers /readyz 503 and POST /drain with the recorded report,
    and its reconciler never registers a version again (re-opening serving)."""
    pod = start_pod(tmp_path / "before")
    try:
        with pod.client() as c:
            r = c.post("/drain", headers=AUTH)
            assert r.status_code == 200 and r.json()["drained"], r.text
            assert c.get("/readyz").status_code == 503
    finally:
        pod.stop()
    marker = tmp_path / "before" / "deltas" / ".drained.json"
    assert marker.exists()
    # the restart: a fresh, empty TorchServe fake, the same pod-local marker
    pod = start_pod(tmp_path / "after", converge=False, drain_file=marker)
    try:
        with pod.client() as c:
            r = c.get("/readyz")
            assert r.status_code == 503 and "shutting down" in r.json()["message"], r.text
            r = c.post("/drain", headers=AUTH)
            assert r.status_code == 200 and r.json()["phase"] == "drained", r.text
            time.sleep(0.3)  # several reconcile intervals (0.05 s): nothing re-opens
            assert pod.ts.versions == {} and c.get("/readyz").status_code == 503
    finally:
        pod.stop()


def test_a_memory_backed_delta_folder_counts_in_the_switch_memory_check(tmp_path: Path
                                                                       ) -> None:
    """tmpfs/ramfs (longest mount point wins) is memory-backed; its bytes are added to
    an RSS-based usage (the cgroup's working set already holds them)."""
    from serve.sidecar.adapters.memory import CgroupMemory, MemoryProbe, is_memory_backed

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /pod/deltas tmpfs rw 0 0\n"
                      "/dev/vdb /pod/deltas/disk ext4 rw 0 0\n")
    assert is_memory_backed(Path("/pod/deltas/v1"), mounts)
    assert not is_memory_backed(Path("/pod/deltas/disk/v1"), mounts)
    assert not is_memory_backed(Path("/pod/deltasx"), mounts)
    assert not is_memory_backed(Path("/pod"), tmp_path / "no-mounts")
    probe = MemoryProbe(CgroupMemory(tmp_path / "none"), limit_bytes=1 << 30,
                        rss=lambda pid: 100 << 20, held=lambda: 50 << 20)
    used, basis = probe.usage([1, 2])
    assert used == 250 << 20 and "50 MiB in the memory-backed delta folder" in basis


def test_the_torchserve_prestop_waits_for_the_drain_without_a_token(tmp_path: Path) -> None:
    """``python -m serve.ops.drain --wait`` (the torchserve container's preStop) reads
    GET /drain, with no token, until the sidecar's own preStop (POST /drain, the operator
    token) has drained the pod; before that it keeps waiting, and it gives up at its
    timeout with the last answer."""
    import threading

    from serve.errors import UpstreamUnavailable
    from serve.ops.drain import main as drain_main
    from serve.ops.drain import wait_drained

    pod = start_pod(tmp_path)
    try:
        with pod.client() as c:
            r = c.get("/drain")  # a read: no token
            assert r.status_code == 200 and r.json()["drained"] is False
            assert r.json()["phase"] == "serving"
        with pytest.raises(UpstreamUnavailable, match="did not report the pod drained"):
            wait_drained(pod.url, 0.3, poll_s=0.05)
        codes: list[int] = []
        waiter = threading.Thread(target=lambda: codes.append(
            drain_main(["--wait", "--sidecar-url", pod.url, "--timeout-s", "20"])))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and codes == []  # still waiting: nothing drained it
        with pod.client() as c:
            assert c.post("/drain", headers=AUTH).json()["drained"]
        waiter.join(timeout=10)
        assert codes == [0]
    finally:
        pod.stop()
