"""The sidecar's embedding-delta API (serve.sidecar.http.routes_deltas, serve.sidecar.services.deltas):
the real app under uvicorn on 127.0.0.1 with a fake TorchServe management API, a model
repository of ``tiny`` int8 versions, and worker statuses written by the test exactly as
the workers write them (``DeltaStore.write_worker_status``)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

import serve.store.deltas.format
from serve.common.net import free_port, wait_until
from serve.profiles import get_profile
from serve.rowformat import row_bytes
from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.app import create_app
from serve.sidecar.services.deltas.parts import DeltaParts
from serve.state import Batching, DesiredState, ModelRef, write_state
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta, DeltaTable, encode_delta, version_digest
from serve.store.deltas.status import WorkerStatus
from serve.store.repository import ModelRepository
from tests.fixtures.deltas import delta_parts, digest
from tests.fixtures.sidecar import FakeClock, FakeTorchServe, toy_mar
from tests.promtext import samples

TOKEN = "delta-t0ken-for-tests-delta-t0ken-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVED, OTHER = "tiny-a", "tiny-b"
TINY = get_profile("tiny")
RB = row_bytes("int8", TINY.embedding_dim)
NOW = 1_800_000_000.0  # the sidecar's wall clock in these tests
#: The build reports of the repository's versions (start_pod), which their delta 1 names.
REPORTS = {v: {"created_at": f"2026-01-01T00:00:0{i}Z", "version": v, "profile": "tiny",
               "quantized_dtype": "int8"} for i, v in enumerate((SERVED, OTHER))}
#: ``make_delta``'s default parent: the version's identity for delta 1.
BASE = "base"


def base_digest(version: str = SERVED) -> str:
    """The parent delta 1 of ``version`` names: its identity (``version_digest``)."""
    return version_digest(REPORTS[version])


# ------------------------------------------------------------------ deltas


def make_delta(sequence: int, version: str = SERVED, *, tables: tuple[tuple[int, list[int]], ...]
               = ((0, [1, 5, 9]), (3, [0, 2])), created_at: float = NOW - 60.0,
               dim: int | None = None, feature_of: dict[int, str] | None = None,
               parent: str | None = BASE) -> bytes:
    """A delta file of ``version`` changing ``ids`` of each ``(table, ids)``. ``parent``:
    its ``parent_digest`` (:data:`BASE`: the version's identity for delta 1, none for a
    later one or a version outside the repository: pass the previous file's digest)."""
    if parent == BASE:
        parent = base_digest(version) if sequence == 1 and version in REPORTS else None
    dim = TINY.embedding_dim if dim is None else dim
    rb = row_bytes("int8", dim)
    rng = np.random.default_rng(sequence)
    out = []
    for t, ids in tables:
        feature = (feature_of or {}).get(t, TINY.feature_names[t])
        out.append(DeltaTable(feature, t, np.asarray(ids, dtype=np.int64),
                              rng.integers(0, 256, (len(ids), rb), dtype=np.uint8)))
    return encode_delta(Delta(version, sequence, created_at, "int8", dim, rb, tuple(out),
                              parent))


def status(pid: int, sequence: int, *, version: str = SERVED, rows: int = 0,
           apply_seconds: float = 0.0, created_at: float = 0.0) -> WorkerStatus:
    return WorkerStatus(pid=pid, version=version, sequence=sequence, rows=rows,
                        apply_seconds=apply_seconds, applied_at=NOW, created_at=created_at)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (the delta store) with its bytes."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------ the running sidecar


@dataclass
class Pod:
    url: str
    delta_dir: Path | None
    ts: FakeTorchServe
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def store(self) -> DeltaStore:
        assert self.delta_dir is not None
        return DeltaStore(self.delta_dir)

    def pids(self) -> list[int]:
        """The fake TorchServe's worker pids (of the version it serves)."""
        return sorted(p for v in self.ts.versions.values() for p in v["pids"])

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_pod(tmp_path: Path, *, deltas: bool = True, workers: int = 2,
              converge: bool = True, **config: Any) -> Pod:
    """The sidecar app under uvicorn, serving version ``tiny-a`` (``tiny-b`` is in the
    repository, not served) on a fake TorchServe with ``workers`` workers."""
    root = tmp_path / "repo"
    repo = ModelRepository([root])
    root.mkdir(parents=True, exist_ok=True)
    for version in (SERVED, OTHER):
        src = toy_mar(tmp_path / f"src-{version}.mar", version=version)
        repo.add(version, src, REPORTS[version])
    state_file = tmp_path / "state" / "state.yaml"
    write_state(state_file, DesiredState(
        model=ModelRef(version=SERVED),
        batching=Batching(batch_size=8, max_batch_delay_ms=50), workers=workers))
    ts = FakeTorchServe(tmp_path / "store", initial=None)
    delta_dir = tmp_path / "deltas" if deltas else None
    cfg = SidecarConfig(
        management_url="http://ts.invalid:8081", metrics_url="http://ts.invalid:8082",
        inference_url="http://ts.invalid:8080", token=TOKEN, model_store=ts.store,
        switch_grace_s=0.0, state_file=state_file, repositories=(root,),
        cgroup_root=tmp_path / "no-cgroup", reconcile_interval_s=0.05, delta_dir=delta_dir,
        **config)
    app = create_app(cfg, http_client=httpx.AsyncClient(transport=ts.transport()),
                     wall_clock=lambda: NOW)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    pod = Pod(f"http://127.0.0.1:{port}", delta_dir, ts, server, thread)
    try:
        wait_until(lambda: server.started, timeout_s=30, what="uvicorn", interval_s=0.02)
        if converge:
            wait_until(lambda: httpx.get(f"{pod.url}/state", timeout=5).json()["converged"],
                       timeout_s=30, what="GET /state converged", interval_s=0.05)
    except BaseException:
        pod.stop()
        raise
    assert not converge or len(pod.pids()) == workers
    return pod


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    p = start_pod(tmp_path)
    try:
        yield p
    finally:
        p.stop()


def post(c: httpx.Client, body: bytes | Iterable[bytes], wait_s: float | None = 0, **headers: str
         ) -> httpx.Response:
    params = {} if wait_s is None else {"wait_s": wait_s}
    return c.post("/embeddings/deltas", content=body, params=params,
                  headers={**AUTH, "Content-Type": serve.store.deltas.format.DELTA_MEDIA_TYPE, **headers})


def refused(pod: Pod, c: httpx.Client, body: bytes | Iterable[bytes], status: int, field: str | None,
            message: str, **kw: Any) -> dict[str, Any]:
    """POST ``body``, expect ``status`` with ``field`` and ``message`` in the message;
    the store is unchanged and the sidecar still healthy."""
    assert pod.delta_dir is not None
    before = snapshot(pod.delta_dir)
    r = post(c, body, **kw)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["code"] == status
    if field is not None:
        assert got["field"] == field, got
    assert message in got["message"], got
    # A chunked body over the limit is answered by the edge guard as soon as it passes
    # the limit; the route then drops what it had written when it is told the client
    # left, a moment after the answer.
    wait_until(lambda: snapshot(pod.delta_dir) == before, timeout_s=5,  # type: ignore[arg-type]
               what="the store back as it was", interval_s=0.02)
    assert c.get("/healthz").status_code == 200
    return got


# ------------------------------------------------------------------ 4xx


def test_every_refusal_names_the_fault_and_changes_nothing(pod: Pod) -> None:
    store = pod.store
    for pid in pod.pids():
        store.write_worker_status(status(pid, 0))
    good = make_delta(1)
    with pod.client() as c:
        r = c.post("/embeddings/deltas", content=good)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert snapshot(pod.delta_dir) == {  # type: ignore[arg-type]
            f"{SERVED}/workers/{pid}.json": json.dumps(status(pid, 0).to_json()).encode()
            for pid in pod.pids()}
        refused(pod, c, b"NOTADELTA!!" + good[11:], 400, "magic", "must start with")
        refused(pod, c, good[:-5], 400, "payload", "truncated or padded")
        flipped = bytearray(good)
        flipped[-1] ^= 0x01
        refused(pod, c, bytes(flipped), 400, "sha256", "does not match")
        refused(pod, c, make_delta(1, dim=8), 400, "header.dim", "8 does not match the "
                "model's 16")
        n0 = TINY.cardinalities[0]
        refused(pod, c, make_delta(1, tables=((0, [1, n0]),)), 400, "tables[0].ids",
                f"ids must be in [0, {n0})")
        refused(pod, c, make_delta(1, tables=((2, [1]),), feature_of={2: TINY.feature_names[3]}),
                400, "tables[0].feature", "is not one of the model's features at that index")
        got = refused(pod, c, make_delta(1, version=OTHER), 409, "header.base_version",
                      f"'{OTHER}' is not served by this pod, which serves ['{SERVED}']")
        assert got["type"] == "DeltaConflict"
        refused(pod, c, make_delta(1, version="nowhere-9"), 409, "header.base_version",
                "is not served")
        refused(pod, c, good, 400, None, "wait_s", wait_s=301)
        # a good one, then other bytes under its sequence and one that skips (the same
        # bytes again are stored once: tests/test_deltas_durability.py)
        r = post(c, good)
        assert r.status_code == 202, r.text
        refused(pod, c, make_delta(1, created_at=NOW - 1.0), 409, "header.sequence",
                "1 was already applied with other bytes: version "
                f"{SERVED} is at sequence 1, so the next delta must be 2")
        refused(pod, c, make_delta(3), 409, "header.sequence", "3 skips a delta")
        assert pod.store.sequences(SERVED) == [1]


def test_a_body_over_the_limit_is_413_and_stored_nowhere(tmp_path: Path) -> None:
    """Over --max-delta-bytes: 413 from Content-Length before a byte is read, and while
    a body without a length streams in; at the limit: stored."""
    body = make_delta(1)
    pod = start_pod(tmp_path, max_delta_bytes=len(body) - 1)
    try:
        with pod.client() as c:
            got = refused(pod, c, body, 413, None, f"{len(body)} bytes is over the "
                          f"{len(body) - 1}-byte limit")
            assert got["type"] == "PayloadTooLarge"
            chunks = (body[i:i + 100] for i in range(0, len(body), 100))  # chunked: no length
            got = refused(pod, c, chunks, 413, None, f"is over the {len(body) - 1}-byte limit")
            assert not [p for p in pod.delta_dir.iterdir()  # type: ignore[union-attr]
                        if p.name.startswith(".incoming")]
            assert c.get("/embeddings/deltas").json()["max_bytes"] == len(body) - 1
    finally:
        pod.stop()
    pod = start_pod(tmp_path / "at-limit", max_delta_bytes=len(body))
    try:
        with pod.client() as c:
            assert post(c, body).status_code == 202
    finally:
        pod.stop()


# ------------------------------------------------------------------ 200 / 202


def test_a_good_delta_is_200_once_every_live_worker_applied_it(pod: Pod) -> None:
    store, pids = pod.store, pod.pids()
    for pid in pids:
        store.write_worker_status(status(pid, 0))
    store.write_worker_status(status(99999, 0))  # a dead worker's file: never waited for
    body = make_delta(1)

    def workers_apply() -> None:
        wait_until(lambda: store.sequences(SERVED) == [1], timeout_s=10, what="the delta",
                   interval_s=0.01)
        time.sleep(0.2)
        for i, pid in enumerate(pids):
            store.write_worker_status(status(pid, 1, rows=5, apply_seconds=0.01 * (i + 1),
                                             created_at=NOW - 60.0))

    applier = threading.Thread(target=workers_apply)
    applier.start()
    with pod.client() as c:
        r = post(c, body, wait_s=10)
    applier.join()
    assert r.status_code == 200, r.text
    got = r.json()
    assert 0.15 <= got.pop("waited_s") < 10
    assert got == {"version": SERVED, "sequence": 1, "rows": 5, "bytes": len(body),
                   "applied": True,
                   "workers": [{"pid": pid, "sequence": 1, "apply_seconds": 0.01 * (i + 1)}
                               for i, pid in enumerate(pids)],
                   "message": f"stored and applied by all 2 live worker(s) serving {SERVED}"}
    assert pod.store.path(SERVED, 1).read_bytes() == body


def test_202_when_the_workers_do_not_apply_within_wait_s(pod: Pod) -> None:
    store, pids = pod.store, pod.pids()
    store.write_worker_status(status(pids[0], 0))
    store.write_worker_status(status(pids[1], 0))
    with pod.client() as c:
        t0 = time.monotonic()
        r = post(c, make_delta(1), wait_s=0.2)
        took = time.monotonic() - t0
    assert r.status_code == 202, r.text
    got = r.json()
    assert got["applied"] is False and got["sequence"] == 1
    assert 0.2 <= got["waited_s"] < 1.0 and took >= 0.2
    assert [w["sequence"] for w in got["workers"]] == [0, 0]
    assert got["message"].startswith(f"stored; 0 of 2 live worker(s) serving {SERVED} "
                                     "applied it within 0.2 s")
    assert store.sequences(SERVED) == [1]  # stored: the workers still apply it


def test_no_worker_reporting_is_not_applied(pod: Pod) -> None:
    with pod.client() as c:
        r = post(c, make_delta(1), wait_s=0.1)
    assert r.status_code == 202 and r.json()["workers"] == [] and not r.json()["applied"]


# ------------------------------------------------------------------ GET, /state, /metrics


def test_state_get_and_metrics_report_the_same_values(pod: Pod) -> None:
    store, (a, b) = pod.store, pod.pids()
    with pod.client() as c:
        first = make_delta(1, created_at=NOW - 600.0)
        assert post(c, first).status_code == 202
        second = make_delta(2, created_at=NOW - 30.0, parent=digest(first))
        assert post(c, second).status_code == 202
        # a has applied both, b only the first; a dead pid claims more and is ignored
        store.write_worker_status(status(a, 2, rows=10, apply_seconds=0.02,
                                         created_at=NOW - 30.0))
        store.write_worker_status(status(b, 1, rows=5, apply_seconds=0.07,
                                         created_at=NOW - 600.0))
        store.write_worker_status(status(99999, 9, rows=99, apply_seconds=9.0,
                                         created_at=NOW))
        (store.folder(SERVED) / "workers" / "12345.json").write_text("{half a fi")
        expected = {"last_sequence": 2, "head_digest": digest(second),
                    "applied_sequence": 1, "rows_updated": 5,
                    "apply_seconds_max": 0.07, "newest_delta_created_at": NOW - 600.0,
                    "newest_delta_age_s": 600.0, "id_maps": [],  # a modulo version
                    "workers": [status(p, s, rows=r, apply_seconds=x, created_at=t).to_json()
                                for p, s, r, x, t in sorted([
                                    (a, 2, 10, 0.02, NOW - 30.0),
                                    (b, 1, 5, 0.07, NOW - 600.0)])]}
        st = c.get("/state").json()
        assert st["embeddings"] == {SERVED: expected}
        got = c.get("/embeddings/deltas").json()
        assert got == {"enabled": True, "delta_dir": str(pod.delta_dir),
                       "versions": {SERVED: expected}, "message": None, "damaged": [],
                       "max_bytes": serve.store.deltas.format.MAX_DELTA_BYTES,
                       "signatures": "not verified"}
        r = c.get("/metrics")
        assert r.status_code == 200
        m = samples(r.text)
    v = (("version", SERVED),)
    assert m[("dlrm_embedding_delta_sequence", v)] == 2
    assert m[("dlrm_embedding_delta_applied_sequence", v)] == 1
    assert m[("dlrm_embedding_delta_rows_updated", v)] == 5
    assert m[("dlrm_embedding_delta_apply_seconds", v)] == pytest.approx(0.07)
    assert m[("dlrm_embedding_delta_created_timestamp_seconds", v)] == NOW - 600.0
    delta_series = {k for k in m if k[0].startswith("dlrm_embedding_delta_")}
    assert {labels for _, labels in delta_series} == {v}  # served versions only


def test_without_delta_dir_post_is_409_and_state_has_no_embeddings(tmp_path: Path) -> None:
    pod = start_pod(tmp_path, deltas=False, workers=1)
    try:
        with pod.client() as c:
            r = post(c, make_delta(1))
            assert r.status_code == 409
            assert "started without --delta-dir (or DLRM_DELTA_DIR)" in r.json()["message"]
            got = c.get("/embeddings/deltas").json()
            assert got["enabled"] is False and got["versions"] == {}
            assert "--delta-dir" in got["message"]
            assert "embeddings" not in c.get("/state").json()
            assert "dlrm_embedding_delta_sequence" not in c.get("/metrics").text
            assert c.get("/healthz").status_code == 200
    finally:
        pod.stop()


def test_cli_delta_dir_and_its_env_default(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    from serve.sidecar.http.app import build_parser

    monkeypatch.delenv("DLRM_DELTA_DIR", raising=False)
    assert build_parser().parse_args([]).delta_dir is None
    monkeypatch.setenv("DLRM_DELTA_DIR", str(tmp_path / "env"))
    assert build_parser().parse_args([]).delta_dir == str(tmp_path / "env")
    assert build_parser().parse_args(["--delta-dir", "/x"]).delta_dir == "/x"
    assert SidecarConfig(delta_dir="d").delta_dir == Path("d")  # type: ignore[arg-type]


# ------------------------------------------------------------------ units: the wait


def _service(tmp_path: Path, pids: list[int], clock: FakeClock,
             on_sleep: Any = None) -> DeltaParts:
    async def live() -> list[int]:
        return pids

    async def sleep(seconds: float) -> None:
        await clock.sleep(seconds)
        if on_sleep is not None:
            on_sleep(clock.now)

    return delta_parts(DeltaStore(tmp_path), versions=lambda: [SERVED],
                       report_of=lambda v: REPORTS[v],
                       live_pids=live, clock=clock, wall_clock=lambda: NOW, sleep=sleep,
                       pid_ttl_s=0.0)


def test_wait_polls_every_50_ms_until_the_slowest_live_worker_reports(tmp_path: Path) -> None:
    clock = FakeClock()
    store = DeltaStore(tmp_path)
    for pid in (1, 2):
        store.write_worker_status(status(pid, 0))

    def workers(now: float) -> None:  # worker 1 at 0.1 s, worker 2 at 0.3 s
        if now >= 0.1 - 1e-9:
            store.write_worker_status(status(1, 3))
        if now >= 0.3 - 1e-9:
            store.write_worker_status(status(2, 3))

    svc = _service(tmp_path, [1, 2], clock, workers)
    res = asyncio.run(svc.progress.wait_applied(SERVED, 3, wait_s=30))
    assert res.applied and res.waited_s == pytest.approx(0.3)
    assert clock.sleeps == pytest.approx([0.05] * 6)
    assert [(w.pid, w.sequence) for w in res.workers] == [(1, 3), (2, 3)]


def test_wait_gives_up_at_wait_s_and_zero_looks_once(tmp_path: Path) -> None:
    clock = FakeClock()
    DeltaStore(tmp_path).write_worker_status(status(1, 0))
    svc = _service(tmp_path, [1], clock)
    res = asyncio.run(svc.progress.wait_applied(SERVED, 1, wait_s=0.12))
    assert not res.applied and res.waited_s == pytest.approx(0.12)
    assert clock.sleeps == pytest.approx([0.05, 0.05, 0.02])
    clock.sleeps.clear()
    res = asyncio.run(svc.progress.wait_applied(SERVED, 1, wait_s=0))
    assert not res.applied and res.waited_s == 0 and clock.sleeps == []
    # no live worker reporting: never applied (pid 1's file, but pid 1 is not live)
    svc = _service(tmp_path, [7], FakeClock())
    assert asyncio.run(svc.progress.wait_applied(SERVED, 0, wait_s=0)).applied is False


def test_collect_survives_garbage_and_uses_the_last_known_pids(tmp_path: Path) -> None:
    store = DeltaStore(tmp_path)
    store.write_worker_status(status(1, 1, rows=3, apply_seconds=0.5, created_at=NOW - 5))
    (store.folder(SERVED) / "workers" / "2.json").write_bytes(b"\x00\xff not json")
    (store.folder(SERVED) / "workers" / "3.json").write_text('{"pid": 3}')
    svc = _service(tmp_path, [1, 2, 3], FakeClock())
    asyncio.run(svc.progress.live_pids())  # what a request would have read
    registry = CollectorRegistry()
    registry.register(svc.report)
    m = samples(generate_latest(registry).decode())
    v = (("version", SERVED),)
    assert m[("dlrm_embedding_delta_sequence", v)] == 0
    assert m[("dlrm_embedding_delta_applied_sequence", v)] == 1
    assert m[("dlrm_embedding_delta_rows_updated", v)] == 3
    assert m[("dlrm_embedding_delta_apply_seconds", v)] == 0.5
    assert m[("dlrm_embedding_delta_created_timestamp_seconds", v)] == NOW - 5


# ------------------------------------------------------------------ the model volume


def test_sync_takes_the_volumes_deltas_in_order_through_the_same_checks(tmp_path: Path) -> None:
    """Deltas published on the model volume reach the store in sequence order; a gap
    waits, a damaged file stops the version there (logged), nothing else changes."""
    svc = _service(tmp_path / "store", [], FakeClock())
    volume = tmp_path / "repo" / "deltas" / SERVED
    volume.mkdir(parents=True)
    one, two = make_delta(1), make_delta(2, parent=digest(make_delta(1)))
    (volume / f"dlrm-{SERVED}-00000001.delta").write_bytes(one)
    (volume / f"dlrm-{SERVED}-00000003.delta").write_bytes(make_delta(3, parent=digest(two)))
    (volume / "notes.txt").write_text("not a delta")
    got = svc.volume.sync([tmp_path / "empty-root", tmp_path / "repo"])
    assert [a.sequence for a in got] == [1]          # 3 waits for 2
    assert svc.store.sequences(SERVED) == [1]
    bad = bytearray(two)
    bad[-1] ^= 1
    (volume / f"dlrm-{SERVED}-00000002.delta").write_bytes(bytes(bad))
    assert svc.volume.sync([tmp_path / "repo"]) == [] and svc.store.sequences(SERVED) == [1]
    (volume / f"dlrm-{SERVED}-00000002.delta").write_bytes(two)
    assert [a.sequence for a in svc.volume.sync([tmp_path / "repo"])] == [2, 3]
    assert svc.volume.sync([tmp_path / "repo"]) == []        # once
    assert svc.store.sequences(SERVED) == [1, 2, 3]


def test_a_new_pod_is_ready_only_once_its_workers_have_the_volumes_deltas(
        tmp_path: Path) -> None:
    """A pod started after deltas were published: /readyz is 503 until the sidecar took
    them from the volume and every live worker applied them; then 200, and it stays 200
    while a later delta is being applied (latched: no flapping out of the Service)."""
    volume = tmp_path / "repo" / "deltas" / SERVED
    volume.mkdir(parents=True)
    one = make_delta(1)
    (volume / f"dlrm-{SERVED}-00000001.delta").write_bytes(one)
    pod = start_pod(tmp_path)
    try:
        with pod.client() as c:
            wait_until(lambda: pod.store.sequences(SERVED) == [1], timeout_s=30,
                       what="the volume's delta in the store", interval_s=0.05)
            r = c.get("/readyz")
            assert r.status_code == 503 and "applied embedding delta 0 of 1" in r.json()["message"]
            for pid in pod.pids():
                pod.store.write_worker_status(status(pid, 1))
            assert c.get("/readyz").status_code == 200
            assert post(c, make_delta(2, parent=digest(one))).status_code == 202  # not applied
            assert c.get("/readyz").status_code == 200
    finally:
        pod.stop()
