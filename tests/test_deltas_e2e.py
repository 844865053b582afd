"""Embedding deltas end to end: the real launcher, TorchServe (2 workers sharing one copy of
the tables), the sidecar, and ``POST /embeddings/deltas`` under load.

* 0 failed requests while a delta is applied under load (8 clients, 512 instances each);
  the count served is printed (``pytest -s``) and asserted > 0;
* after the delta, predictions over HTTP equal, bit for bit, those of a runtime built
  directly from an artifact that has the updated rows;
* a delta with a wrong base version, a repeated sequence or a bad checksum gets a 4xx
  naming the problem, nothing changes, and the service keeps serving.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch

from serve.api.binary import encode_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.ops.loadgen import BackgroundLoad
from serve.runtime.artifact import Artifact, load_artifact, quantize_rows_reference, row_bytes
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.store.deltas.format import (
    Delta,
    DeltaTable,
    encode_delta,
    version_digest,
)
from serve.store.repository import ModelRepository
from tests.fixtures.deltas import with_delta_rows
from tests.fixtures.served import Served, serve_repository
from tests.fixtures.torchserve import tiny_random_artifact
from tests.promtext import samples

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VERSION = "tiny-d"
REPORT = {"version": VERSION, "profile": "tiny", "quantized_dtype": "int8",
          "created_at": "2026-12-01T00:00:00+00:00", "mar_batch_size": 2,
          "mar_max_batch_delay_ms": 2, "mar_workers": 2}
F, N = 26, 13


@dataclass
class DeltaServed(Served):
    """The service over one random tiny version, and that version's artifact."""

    artifact: Artifact

    def predict(self, body: bytes) -> np.ndarray:
        return np.asarray(self.predictions(body), dtype=np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeltaServed]:
    from serve.model.archive import build_mar

    root = tmp_path_factory.mktemp("deltas")
    art_path = tiny_random_artifact(root / "artifact.pt", seed=5)
    mar = build_mar(art_path, root / "build", model_name="dlrm", version=VERSION,
                    batch_size=2, max_batch_delay_ms=2,
                    handler_config={"num_threads": 1, "max_instances": 1024},
                    min_workers=2, max_workers=2, file_name=f"{VERSION}.mar")
    repo = ModelRepository([root / "model_store"])
    repo.add(VERSION, mar, REPORT)
    state = {"model": {"version": VERSION}, "batching": {"batch_size": 2, "max_batch_delay_ms": 2},
             "workers": 2}
    with serve_repository(root, state=state, kind=DeltaServed,
                          fields={"artifact": load_artifact(art_path, mmap=False)}) as s:
        yield s


def _delta(art: Artifact, sequence: int, seed: int, base: str = VERSION,
           parent: str | None = None) -> Delta:
    """New rows for the hot ids (0..99) and random others of 6 tables; ``parent``: its
    ``parent_digest`` (delta 1: ``version_digest(REPORT)``)."""
    g = torch.Generator().manual_seed(seed)
    tables = []
    for t in (0, 2, 5, 11, 19, 25):
        qt = art.tables[t]
        ids = torch.unique(torch.cat([torch.arange(min(100, qt.rows)),
                                      torch.randint(0, qt.rows, (qt.rows // 4,), generator=g)]))
        w = (torch.rand((ids.numel(), art.embedding_dim), generator=g) - 0.5) * 2.0
        tables.append(DeltaTable(art.table_feature(t), t, ids.numpy().astype(np.int64),
                                 quantize_rows_reference(w, art.dtype).numpy()))
    return Delta(base, sequence, time.time(), art.dtype, art.embedding_dim,
                 row_bytes(art.dtype, art.embedding_dim), tuple(tables), parent)




def _requests(n: int, b: int, seed: int) -> list[tuple[bytes, tuple]]:
    """Binary bodies of b one-hot instances with hot ids (Zipf over 0..199)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        dense = rng.standard_normal((b, N)).astype(np.float32)
        lengths = np.ones((F, b), dtype=np.int32)
        values = np.minimum(rng.zipf(1.3, F * b) - 1, 10_000).astype(np.int64)
        out.append((encode_binary(dense, lengths, values), (dense, values, lengths)))
    return out


def test_delta_under_load_is_exact_and_fails_nothing(served: DeltaServed) -> None:
    reqs = _requests(16, 512, seed=1)
    fixed_body, fixed_arrays = reqs[0]
    before = served.predict(fixed_body)
    stale = Runtime.from_artifact(served.artifact, RuntimeConfig()).predict_arrays(*fixed_arrays)
    assert np.array_equal(before, stale), "the service does not serve the artifact exactly"
    d1 = _delta(served.artifact, 1, seed=11, parent=version_digest(REPORT))
    with BackgroundLoad(served.predict_url, [b for b, _ in reqs], clients=8,
                        content_type=BINARY_MEDIA_TYPE) as load:
        load.wait_for(16)
        r = served.post_delta(encode_delta(d1))
        at = load.served
        load.wait_for(at + 16)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["applied"] is True and res["sequence"] == 1 and res["rows"] == d1.rows
    assert len(res["workers"]) == 2, res   # both workers report it
    print(f"\ndelta #1 ({d1.rows} rows, {res['bytes']} bytes) under 8 clients x 512: served "
          f"{load.served}, failed {load.failed}; apply s per worker "
          f"{[w['apply_seconds'] for w in res['workers']]}")
    assert load.failed == 0 and load.served > 0
    ref = Runtime.from_artifact(with_delta_rows(served.artifact, d1), RuntimeConfig())
    for body, arrays in reqs[:4]:
        got = served.predict(body)   # either worker: both must serve the delta
        assert np.array_equal(got, ref.predict_arrays(*arrays))
    assert not np.array_equal(served.predict(fixed_body), before)

    st = httpx.get(f"{served.write_url}/state", timeout=10).json()
    emb = st["embeddings"][VERSION]
    assert emb["last_sequence"] == 1 and emb["applied_sequence"] == 1
    assert emb["rows_updated"] == d1.rows and len(emb["workers"]) == 2
    m = samples(httpx.get(f"{served.write_url}/metrics", timeout=10).text)
    lab = (("version", VERSION),)
    assert m[("dlrm_embedding_delta_applied_sequence", lab)] == 1
    assert m[("dlrm_embedding_delta_created_timestamp_seconds", lab)] == pytest.approx(
        d1.created_at)


def test_refused_deltas_change_nothing_and_the_service_keeps_serving(served: DeltaServed) -> None:
    body, _ = _requests(1, 64, seed=2)[0]
    before = served.predict(body)
    last = httpx.get(f"{served.write_url}/state", timeout=10).json()["embeddings"][VERSION][
        "last_sequence"]
    wrong_base = served.post_delta(encode_delta(_delta(served.artifact, last + 1, 3, "tiny-x")))
    repeated = served.post_delta(encode_delta(_delta(served.artifact, max(last, 1), 4)))
    damaged = bytearray(encode_delta(_delta(served.artifact, last + 1, 5)))
    damaged[-10] ^= 0x55
    bad_sum = served.post_delta(bytes(damaged))
    head = httpx.get(f"{served.write_url}/embeddings/deltas", timeout=10).json()[
        "versions"][VERSION]["head_digest"]
    other_chain = served.post_delta(encode_delta(_delta(served.artifact, last + 1, 6,
                                                        parent="0" * 64)))
    assert other_chain.status_code == 409, other_chain.text
    got = other_chain.json()
    assert (got["field"], got["reason"]) == ("header.parent_digest", "parent_mismatch")
    assert (got["parent_digest"], got["expected_parent_digest"]) == ("0" * 64, head)
    assert "0" * 64 in got["message"] and head in got["message"]
    assert wrong_base.status_code == 409 and "tiny-x" in wrong_base.json()["message"]
    assert repeated.status_code == 409 and repeated.json()["field"] == "header.sequence"
    assert bad_sum.status_code == 400 and bad_sum.json()["field"] == "sha256"
    after = httpx.get(f"{served.write_url}/state", timeout=10).json()["embeddings"][VERSION]
    assert after["last_sequence"] == last
    assert np.array_equal(served.predict(body), before)


def test_ids_beyond_a_table_are_counted_per_feature(served: DeltaServed) -> None:
    rows0 = served.artifact.tables[0].rows
    dense = np.zeros((3, N), dtype=np.float32)
    lengths = np.ones((F, 3), dtype=np.int32)
    values = np.zeros(F * 3, dtype=np.int64)
    values[:3] = rows0 + np.arange(3)        # C1: 3 ids beyond the table
    key = ("dlrm_embedding_ids_wrapped_total", (("feature", "C1"),))

    def wrapped() -> float:
        return samples(httpx.get(f"{served.write_url}/metrics", timeout=10).text).get(key, 0.0)

    start = wrapped()
    served.predict(encode_binary(dense, lengths, values))
    assert wrapped() == start + 3


def test_evaluate_prints_the_auc_of_the_served_model_as_its_last_line(
        served: DeltaServed, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m serve.ops.evaluate`` on a live endpoint: the last stdout line is JSON with
    auc and rows, and the AUC is that of the served model's scores on those rows (the
    same as an in-process runtime serving what the service serves now)."""
    import json

    from serve.common.quality import roc_auc
    from serve.model.data import ensure_day_data, load_split
    from serve.ops import evaluate
    from serve.ops.heldout import binary_bodies
    from serve.profiles import get_profile

    rows = 3000
    data_dir = ensure_day_data(get_profile("tiny"), 1)
    rc = evaluate.main(["--url", served.cfg.inference_url, "--day", "1", "--profile", "tiny",
                        "--rows", str(rows), "--batch", "500", "--clients", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    res = json.loads(out[-1])
    assert res["rows"] == rows and res["day"] == 1 and res["versions"] == {VERSION: 6}
    # The service now serves the artifact plus every delta accepted so far.
    state = httpx.get(f"{served.write_url}/state", timeout=10).json()
    assert state["embeddings"][VERSION]["applied_sequence"] == 1
    scores = []
    ref = Runtime.from_artifact(with_delta_rows(served.artifact, _delta(served.artifact, 1, seed=11)))
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body

    cfg = HandlerConfig(max_instances=1024)
    for _, _, body in binary_bodies(data_dir, "eval", rows, 500):
        req = parse_body(body, cfg, BINARY_MEDIA_TYPE)
        scores.append(ref.predict_arrays(req.dense, req.values, req.lengths))
    labels = np.asarray(load_split(data_dir, "eval").labels[:rows], dtype=np.float64)
    assert res["auc"] == pytest.approx(roc_auc(labels, np.concatenate(scores)), abs=1e-6)
    assert evaluate.main(["--url", "ftp://x", "--day", "1"]) == 2
