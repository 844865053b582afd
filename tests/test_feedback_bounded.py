"""The feedback join stays bounded over a FULL prediction log, and GET /metrics never waits
for it: a 256 MiB log (the default ``DLRM_PREDICTION_LOG_MAX_BYTES``) of ~2 million
records, a fresh service over it, one label posted: the peak traced memory (tracemalloc,
from the service's creation to the answer) stays under 120 MB, and GET /metrics through
the real sidecar app answers within 2 s while the index is being built.

The full size is ``slow``; the default suite runs the same check over a 32 MiB log
(bound 120 MB x 32/256 + the fixed part). The log is written in the real format: every
record is byte for byte what :func:`serve.store.predlog.encode` writes (checked on a sample),
laid out in bulk with numpy because two million ``encode`` calls take ~10 s.
"""
from __future__ import annotations

import asyncio
import gc
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from serve.sidecar.config import FeedbackConfig, SidecarConfig
from serve.sidecar.http.app import create_app
from serve.sidecar.services.feedback import FeedbackService
from serve.store.predlog import (
    MAGIC,
    SUFFIX,
    Prediction,
    PredictionLogConfig,
    PredictionLogWriter,
    encode,
    log_files,
)
from tests.fixtures.sidecar import FakeTorchServe

MIB = 1 << 20
FILE_BYTES = 8 * MIB  # the writer's default DLRM_PREDICTION_LOG_FILE_BYTES
T0 = 1_700_000_000.123
VERSION, ARM = "v1", "stable"
INSTANCES = 4  # scores per request: small records, the most records per MiB (the worst case)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _uuids(rng: np.random.Generator, n: int) -> np.ndarray:
    """uint8 (n, 36): random uuid4-shaped request ids, as TorchServe's x-request-id."""
    nibbles = rng.integers(0, 16, size=(n, 32), dtype=np.uint8)
    out = np.full((n, 36), ord("-"), dtype=np.uint8)
    cols = [c for c in range(36) if c not in (8, 13, 18, 23)]
    out[:, cols] = _HEX[nibbles]
    return out


def _records(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 (n, record bytes) records as ``encode`` lays them out, their ids (n, 36))."""
    template = encode(Prediction("x" * 36, VERSION, ARM, T0, np.zeros(INSTANCES, np.float32)))
    head = 12
    meta_len = int.from_bytes(template[4:8], "little")
    id_at = head + template[head:].index(b"x" * 36)
    rows = np.empty((n, len(template)), dtype=np.uint8)
    rows[:] = np.frombuffer(template, dtype=np.uint8)
    ids = _uuids(rng, n)
    rows[:, id_at:id_at + 36] = ids
    scores = rng.random((n, INSTANCES), dtype=np.float32)
    rows[:, head + meta_len:] = scores.view(np.uint8).reshape(n, -1)
    return rows, ids


@dataclass(frozen=True)
class FullLog:
    directory: Path
    bytes: int
    records: int
    newest_id: str
    oldest_id: str
    newest_scores: np.ndarray


def write_log(directory: Path, total_bytes: int, seed: int = 0) -> FullLog:
    """``total_bytes`` of log in files of ``FILE_BYTES``, named as the writer names them
    (``<unix ms>-<pid>.dpl``, two workers alternating); returns what a test checks."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    per_file = FILE_BYTES // len(encode(Prediction("x" * 36, VERSION, ARM, T0,
                                                   np.zeros(INSTANCES, np.float32))))
    records, written, k = 0, 0, 0
    first_ids = last_ids = last_rows = None
    while written + FILE_BYTES <= total_bytes:
        rows, ids = _records(rng, per_file)
        name = f"{int(T0 * 1000) + k * 1000:013d}-{100 + k % 2}{SUFFIX}"
        (directory / name).write_bytes(rows.tobytes())
        first_ids = ids if first_ids is None else first_ids
        last_ids, last_rows = ids, rows
        records += per_file
        written += rows.nbytes
        k += 1
    assert first_ids is not None and last_ids is not None and last_rows is not None
    # The layout is encode()'s, byte for byte (a sample of the last file).
    for i in (0, per_file // 2, per_file - 1):
        rid = last_ids[i].tobytes().decode()
        sc = last_rows[i, -4 * INSTANCES:].view("<f4").copy()
        assert encode(Prediction(rid, VERSION, ARM, T0, sc)) == last_rows[i].tobytes()
        assert last_rows[i, :4].tobytes() == MAGIC
    return FullLog(directory, written, records, last_ids[-1].tobytes().decode(),
                   first_ids[0].tobytes().decode(),
                   last_rows[-1, -4 * INSTANCES:].view("<f4").copy())


@dataclass
class Measured:
    peak_bytes: int
    build_s: float
    metrics_s: list[float]
    joined: int
    unknown: int
    indexed: int


def _measure(log: FullLog, tmp_path: Path, index_entries: int) -> Measured:
    """A fresh sidecar app over ``log``; one label posted to its feedback service from a
    thread while GET /metrics is scraped through the app (ASGI, in process) every 50 ms
    until the answer. Peak traced memory from the app's creation to the answer."""
    ts = FakeTorchServe(tmp_path / "store")
    config = SidecarConfig(management_url="http://ts", metrics_url="http://ts",
                           token="t" * 32, model_store=ts.store,
                           cgroup_root=tmp_path / "no-cgroup",
                           feedback=FeedbackConfig(log_dir=log.directory,
                                                   index_entries=index_entries))
    gc.collect()
    tracemalloc.start()
    try:
        app = create_app(config, http_client=httpx.AsyncClient(transport=ts.transport()))
        svc: FeedbackService = app.state.sidecar.feedback
        result: dict[str, int] = {}
        latencies: list[float] = []

        def post() -> None:
            t = time.perf_counter()
            res = svc.post([(log.newest_id, 1, 1), (log.oldest_id, 0, 0)])
            result.update(res.results, build_ms=int((time.perf_counter() - t) * 1000))

        async def scrape() -> None:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://sc") as c:
                    worker = threading.Thread(target=post)
                    worker.start()
                    while worker.is_alive() or not latencies:
                        t = time.perf_counter()
                        r = await c.get("/metrics")
                        latencies.append(time.perf_counter() - t)
                        assert r.status_code == 200 and b"dlrm_feedback_labels_total" in r.content
                        await asyncio.sleep(0.05)
                    worker.join()

        asyncio.run(scrape())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return Measured(peak, result["build_ms"] / 1000, latencies, result["joined"],
                    result["unknown"], len(svc._index or ()))


@pytest.fixture(scope="module")
def log_32mib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullLog]:
    yield write_log(tmp_path_factory.mktemp("predlog32"), 32 * MIB)


@pytest.fixture(scope="module")
def log_256mib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FullLog]:
    yield write_log(tmp_path_factory.mktemp("predlog256"), 256 * MIB)


@pytest.fixture(scope="module")
def app_baseline(tmp_path_factory: pytest.TempPathFactory) -> Measured:
    """The same measurement over a log of two records (written by the real writer): what
    the app, the scrapes and one (version, arm) window (``window_pairs`` x 21 bytes,
    preallocated) take without the index."""
    directory = tmp_path_factory.mktemp("predlog2")
    rng = np.random.default_rng(1)
    preds = [Prediction(f"{i:036d}", VERSION, ARM, T0, rng.random(INSTANCES, dtype=np.float32))
             for i in range(2)]
    writer = PredictionLogWriter(PredictionLogConfig(directory), pid=100)
    writer.write(preds)
    writer.close()
    tiny = FullLog(directory, 0, 2, preds[1].request_id, preds[0].request_id, preds[1].scores)
    return _measure(tiny, tmp_path_factory.mktemp("baseline"), 1)


def _check(log: FullLog, tmp_path: Path, index_entries: int) -> Measured:
    m = _measure(log, tmp_path, index_entries)
    print(f"\nlog {log.bytes / MIB:.0f} MiB, {log.records} records, index_entries "
          f"{index_entries}: peak traced {m.peak_bytes / 1e6:.1f} MB, post (index build + "
          f"join, under tracemalloc) {m.build_s:.2f} s, {len(m.metrics_s)} GET /metrics, "
          f"slowest {max(m.metrics_s) * 1000:.0f} ms, indexed {m.indexed}")
    assert m.joined == 1, "the newest record joins"
    assert m.unknown == 1, "the oldest record is older than the index keeps"
    assert m.indexed == index_entries
    assert max(m.metrics_s) < 2.0, m.metrics_s
    return m


def test_a_32mib_log_builds_a_bounded_index_and_metrics_never_wait(
        log_32mib: FullLog, app_baseline: Measured, tmp_path: Path) -> None:
    """An eighth of the full case: an eighth of the log, of the index and of the bound,
    over what the app takes alone (measured over an empty log)."""
    assert len(log_files(log_32mib.directory)) == 4
    m = _check(log_32mib, tmp_path, FeedbackConfig().index_entries // 8)
    over = m.peak_bytes - app_baseline.peak_bytes
    print(f"app + one window alone {app_baseline.peak_bytes / 1e6:.1f} MB; the index "
          f"{over / 1e6:.1f} MB over it")
    assert over < 120e6 / 8, (m.peak_bytes, app_baseline.peak_bytes)


@pytest.mark.slow
def test_a_full_256mib_log_stays_under_120mb_and_metrics_answer_within_2s(
        log_256mib: FullLog, tmp_path: Path) -> None:
    assert log_256mib.bytes > 255 * MIB and len(log_files(log_256mib.directory)) == 32
    m = _check(log_256mib, tmp_path, FeedbackConfig().index_entries)
    assert m.peak_bytes < 120e6, m.peak_bytes


# ------------------------------------------------------------------ POST /feedback's body

TOKEN = "t" * 32


def _app(tmp_path: Path, max_body_bytes: int) -> Any:
    ts = FakeTorchServe(tmp_path / "store")
    writer = PredictionLogWriter(PredictionLogConfig(tmp_path / "log"), pid=1)
    writer.write([Prediction("r1", VERSION, ARM, T0, np.array([0.25, 0.5], np.float32))])
    writer.close()
    config = SidecarConfig(management_url="http://ts", metrics_url="http://ts", token=TOKEN,
                           model_store=ts.store, cgroup_root=tmp_path / "no-cgroup",
                           feedback=FeedbackConfig(log_dir=tmp_path / "log",
                                                   max_body_bytes=max_body_bytes))
    return create_app(config, http_client=httpx.AsyncClient(transport=ts.transport()))


def _posts(app: Any, requests: list[dict[str, Any]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sc") as c:
                return [await c.post("/feedback", headers={
                    "Authorization": f"Bearer {TOKEN}", **r.pop("headers", {})}, **r)
                    for r in requests]

    return asyncio.run(go())


def test_post_feedback_streams_the_body_and_keeps_its_answers(tmp_path: Path) -> None:
    """The body is read in chunks (here 3 of them, no Content-Length), validated from the
    bytes; the answers and the 400 wording are FastAPI's as before."""
    label = {"request_id": "r1", "index": 1, "label": 1}
    body = orjson.dumps({"labels": [label, {**label, "request_id": "zz"}]})

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 20):
            yield body[i:i + 20]

    json_ct = {"Content-Type": "application/json"}
    bad = [({"labels": [{**label, "label": 2}]}, "labels.0.label"),
           ({"labels": [{**label, "index": -1}]}, "labels.0.index"),
           ({"labels": [{**label, "label": True}]}, "labels.0.label"),
           ({"labels": [{"index": 0, "label": 0}]}, "labels.0.request_id"),
           ({"labels": [{**label, "x": 1}]}, "labels.0.x"),
           ({"labels": []}, "labels"), ({"label": []}, "label"), ([1, 2], "body")]
    got = _posts(_app(tmp_path, 1024), [
        {"content": chunks(), "headers": json_ct},
        {"content": b"{not json", "headers": json_ct},
        {"content": b""},
        {"content": body, "headers": {"Content-Type": "text/plain"}},
        *({"json": b} for b, _ in bad)])
    ok = got[0]
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"received": 2, "joined": 1, "unknown": 1, "expired": 0,
                         "duplicate": 0, "bad_index": 0,
                         "joined_by_arm": [{"version": VERSION, "arm": ARM, "labels": 1}]}
    assert got[1].status_code == 400
    assert got[1].json()["message"] == (
        "invalid POST /feedback body: body: the body is not valid JSON (Expecting property "
        "name enclosed in double quotes at character 1)")
    assert got[2].status_code == 400 and "body: Field required" in got[2].json()["message"]
    assert got[3].status_code == 400 and "must be a JSON object sent with Content-Type: " \
        "application/json" in got[3].json()["message"]
    for r, (b, where) in zip(got[4:], bad, strict=True):
        assert r.status_code == 400, (b, r.text)
        assert r.json()["type"] == "InvalidInput" and where in r.json()["message"], r.text


def test_post_feedback_refuses_a_body_over_the_limit_with_413(tmp_path: Path) -> None:
    """From Content-Length before reading; without it, as soon as the bytes received pass
    the limit (the rest is never read)."""
    label = {"request_id": "r1", "index": 1, "label": 1}
    body = orjson.dumps({"labels": [label] * 40})  # ~1.6 KB
    pulled: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for i in range(10_000):  # 640 KB if it were all read
            pulled.append(i)
            yield b" " * 64

    got = _posts(_app(tmp_path, 1024), [
        {"content": body, "headers": {"Content-Type": "application/json"}},
        {"content": endless(), "headers": {"Content-Type": "application/json"}}])
    # the sidecar's edge guard answers first, from the feedback service's own limit
    want = (f"POST /feedback: body: {len(body)} bytes is over the 1024-byte limit (its "
            "Content-Length); split the labels over several POSTs (at most 100000 labels "
            "each), or raise --feedback-max-body-bytes")
    assert got[0].status_code == 413 and got[0].json() == {
        "code": 413, "type": "PayloadTooLarge", "message": want}
    assert got[1].status_code == 413
    assert "bytes is over the 1024-byte limit (read so far" in got[1].json()["message"]
    assert len(pulled) < 100, len(pulled)
