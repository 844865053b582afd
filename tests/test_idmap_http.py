"""Managed id spaces over HTTP: the real launcher, TorchServe (2 workers) and the sidecar,
serving a managed version (6 of the tiny model's 26 tables map raw ids through an id map)
with the embedding cache on (``DLRM_CACHE_ON_CPU=1``, load factor 0.2), LRU and LFU.

* two chained deltas that admit and evict ids are POSTed; after each, HTTP predictions
  (binary bodies mixing admitted, newly admitted, just-evicted and never-seen ids) equal a
  runtime built from the rebuilt artifact (``tests.fixtures.deltas.with_delta_rows``),
  ``torch.equal``;
* ids at 2**63-1, never seen, and evicted a moment ago get their own row or the fallback
  row, never a 5xx (JSON and binary bodies), and ``dlrm_embedding_ids_fallback_total``
  moves by exactly the lookups that read the fallback row;
* the JSON decoder keeps 2**63-1 exact (an admitted id there gets its own row, not the
  fallback a float round trip would give) and refuses 2**63 with a 400 naming the feature;
* GET /state shows ``embeddings.<version>.id_maps`` (capacity, ids, occupancy, admitted,
  evicted, fallback lookups) and /metrics the admitted/evicted counters and occupancy.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from bench.gpu_check import build_random_artifact
from serve.api.binary import encode_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.runtime.artifact import Artifact, save_artifact
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.runtime.idmap import FALLBACK_ROW
from serve.store.deltas.format import Delta, version_digest
from serve.store.repository import ModelRepository
from tests.fixtures.deltas import chained, with_delta_rows
from tests.fixtures.idmaps import MANAGED, VERSION, id_delta, managed_copy, traffic
from tests.fixtures.served import Served, serve_repository

pytestmark = [pytest.mark.integration, pytest.mark.slow]

F, N = 26, 13
MAX = 2**63 - 1
FALLBACK = "dlrm_embedding_ids_fallback_total"


def _report(art: Artifact) -> dict[str, Any]:
    """The build report a managed build writes: its schema (mappings included) and
    ``id_mapping`` with the ids each table admitted."""
    tables = {name: {"admitted": m.size, "capacity": m.capacity, "occupancy": m.occupancy}
              for name, m in art.id_maps.items()}
    return {"version": VERSION, "profile": "tiny", "quantized_dtype": "int8",
            "created_at": "2026-12-01T00:00:00+00:00", "mar_batch_size": 2,
            "mar_max_batch_delay_ms": 2, "mar_workers": 2, "schema": art.schema.to_dict(),
            "id_mapping": {"mapping": "managed", "policy": "test", "threshold": 1,
                           "tables": tables}}


def _body(dense: torch.Tensor, sparse: SparseBatch) -> bytes:
    return encode_binary(dense.numpy().astype(np.float32), sparse.lengths.numpy(),
                         sparse.values.numpy())


@dataclass
class ManagedServed(Served):
    """The service over one managed version (cache policy ``policy``), the chained deltas
    POSTed to it and the HTTP predictions after each."""

    policy: str
    managed: Artifact
    report: dict[str, Any]
    deltas: list[Delta] = field(default_factory=list)
    posted: list[httpx.Response] = field(default_factory=list)
    #: (binary body, dense, sparse, HTTP predictions) after each delta, per delta.
    after: list[list[tuple[bytes, torch.Tensor, SparseBatch, torch.Tensor]]] = field(
        default_factory=list)

    def predict(self, body: bytes, content_type: str = BINARY_MEDIA_TYPE) -> torch.Tensor:
        return torch.tensor(self.predictions(body, content_type), dtype=torch.float32)

    def rebuilt(self) -> Artifact:
        return with_delta_rows(self.managed, *self.deltas)

    def ensure_deltas(self) -> None:
        """Warm the cache with the ids the deltas change, then POST the two chained
        deltas (once per service); after each, keep HTTP predictions of traffic that
        mixes the delta's admitted and evicted ids."""
        if self.deltas:
            return
        d1 = id_delta(self.managed, 11, 1)
        d2 = id_delta(with_delta_rows(self.managed, d1), 12, 2, tables=(0, 2),
                       modulo_tables=(4,))
        now = time.time()
        d1 = dataclasses.replace(d1, created_at=now - 60)
        d2 = dataclasses.replace(d2, created_at=now - 30)
        for step in range(4):   # the cache holds the rows the deltas evict and rewrite
            self.predict(_body(*traffic(self.managed, d1, step, 64, step % 2 == 1)))
        for blob, d in chained([d1, d2], parent=version_digest(self.report)):
            r = self.post_delta(blob, wait_s=60, timeout_s=90)
            self.posted.append(r)
            if r.status_code != 200:
                return
            self.deltas.append(d)
            seen = []
            for step in range(20 + 10 * d.sequence, 24 + 10 * d.sequence):
                dense, sparse = traffic(self.managed, d, step, 96, step % 2 == 1)
                body = _body(dense, sparse)
                seen.append((body, dense, sparse, self.predict(body)))
            self.after.append(seen)


@pytest.fixture(scope="module", params=["lru", "lfu"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedServed]:
    from serve.model.archive import build_mar

    policy = request.param
    root = tmp_path_factory.mktemp(f"idmap-{policy}")
    managed = managed_copy(build_random_artifact("tiny", torch.device("cpu"), seed=3))
    art_path = root / "artifact.pt"
    save_artifact(managed, art_path)
    report = _report(managed)
    mar = build_mar(art_path, root / "build", model_name="dlrm", version=VERSION,
                    batch_size=2, max_batch_delay_ms=2,
                    handler_config={"num_threads": 1, "max_instances": 1024,
                                    "cache_policy": policy, "cache_load_factor": 0.2},
                    min_workers=2, max_workers=2, file_name=f"{VERSION}.mar")
    ModelRepository([root / "model_store"]).add(VERSION, mar, report)
    state = {"model": {"version": VERSION}, "batching": {"batch_size": 2, "max_batch_delay_ms": 2},
             "workers": 2}
    with serve_repository(root, state=state, kind=ManagedServed,
                          fields={"policy": policy, "managed": managed, "report": report},
                          extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                     "DLRM_CACHE_ON_CPU": "1"}) as s:
        yield s


def _fallback_lookups(art: Artifact, sparse: SparseBatch) -> dict[str, int]:
    """Per managed feature, the lookups of ``sparse`` that read the fallback row of
    ``art``'s maps."""
    bounds = [0, *np.cumsum(sparse.lengths.sum(1).tolist()).tolist()]
    out = {}
    for f, t in zip(art.schema.features, art.schema.feature_tables, strict=True):
        name = art.schema.tables[t].name
        if name in art.id_maps:
            i = art.schema.features.index(f)
            v = sparse.values[bounds[i]:bounds[i + 1]]
            out[f.name] = int((art.id_maps[name].lookup(v) == FALLBACK_ROW).sum())
    return out


def _fallback_counter(m: dict[tuple[str, tuple], float]) -> dict[str, float]:
    """``dlrm_embedding_ids_fallback_total`` of the served version, by feature."""
    out = {}
    for (name, labels), v in m.items():
        if name == FALLBACK:
            lab = dict(labels)
            assert lab["version"] == VERSION, lab
            out[lab["feature"]] = v
    return out


# -----------------------------------------------------------------------------------------

def test_managed_admit_evict_deltas_over_http_equal_the_rebuilt_artifact(served: ManagedServed) -> None:
    served.ensure_deltas()
    for r in served.posted:
        assert r.status_code == 200, r.text
        res = r.json()
        assert res["applied"] is True and len(res["workers"]) == 2, res
    assert len(served.deltas) == 2 and served.deltas[0].assigned and served.deltas[0].evicted
    stale = Runtime.from_artifact(served.managed, RuntimeConfig())
    changed = False
    for n, seen in enumerate(served.after, start=1):
        ref = Runtime.from_artifact(with_delta_rows(served.managed, *served.deltas[:n]),
                                    RuntimeConfig())
        for _, dense, sparse, got in seen:
            assert torch.equal(got, ref.predict(dense, sparse)), (served.policy, n)
            changed |= not torch.equal(got, stale.predict(dense, sparse))
    assert changed, "the deltas changed no prediction: the test could not fail"
    m = served.metrics()   # the cache was on: rows came from host memory and were evicted
    assert m[("dlrm_cache_misses_total", ())] > 0 and m[("dlrm_cache_evictions_total", ())] > 0
    # still exact now, on the same traffic (the cache has turned over since)
    ref = Runtime.from_artifact(served.rebuilt(), RuntimeConfig())
    for body, dense, sparse, _ in served.after[0]:
        assert torch.equal(served.predict(body), ref.predict(dense, sparse))


def test_managed_any_int64_id_gets_its_row_or_the_fallback_never_a_5xx(served: ManagedServed) -> None:
    """2**63-1 (admitted at build in C1's map), 2**63-2 and other never-seen ids, ids evicted by
    the last deltas: JSON and binary, all 200, equal to the rebuilt artifact, and the
    fallback counter moves by exactly the lookups that read the fallback row."""
    served.ensure_deltas()
    rebuilt = served.rebuilt()
    ref = Runtime.from_artifact(rebuilt, RuntimeConfig())
    evicted = {}   # per managed table: ids the deltas evicted and did not admit again
    for t in MANAGED:
        gone = [x.evict_ids for d in served.deltas for x in d.tables if x.table == t]
        if gone:
            held = rebuilt.id_maps[rebuilt.schema.tables[t].name].to_numpy()[0]
            evicted[t] = np.setdiff1d(np.concatenate(gone), held)
    b = 6
    rng = np.random.default_rng(7)
    lengths = np.ones((F, b), dtype=np.int32)
    values = rng.integers(0, 500, size=(F, b)).astype(np.int64)
    for t in MANAGED:
        values[t] = [MAX, MAX - 1, 2**62 + 12345, 0, *rng.integers(2**40, 2**50, 2)]
        if t in evicted and evicted[t].size:
            values[t][3:] = np.resize(evicted[t], 3)
    dense = rng.standard_normal((b, N)).astype(np.float32)
    sparse = SparseBatch(torch.from_numpy(values.reshape(-1).copy()), torch.from_numpy(lengths))
    want = ref.predict(torch.from_numpy(dense), sparse)
    expected = _fallback_lookups(rebuilt, sparse)
    assert sum(expected.values()) > 0
    names = [f.name for f in rebuilt.schema.features]
    json_body = orjson.dumps({"instances": [
        {"dense": dense[i].tolist(),
         "sparse": {names[f]: [int(values[f, i])] for f in range(F)}} for i in range(b)]})
    for body, ctype in ((encode_binary(dense, lengths, values.reshape(-1)), BINARY_MEDIA_TYPE),
                        (json_body, "application/json")):
        before = _fallback_counter(served.metrics())
        r = served.post(body, ctype)
        assert r.status_code == 200, (ctype, r.text)
        got = torch.tensor(orjson.loads(r.content)["predictions"], dtype=torch.float32)
        assert torch.equal(got, want), ctype
        after = _fallback_counter(served.metrics())
        moved = {f: after.get(f, 0.0) - before.get(f, 0.0) for f in expected}
        assert moved == {f: float(n) for f, n in expected.items()}, ctype
    assert set(_fallback_counter(served.metrics())) == set(expected), \
        "fallback series exist for the managed features only"


def test_managed_json_keeps_ids_up_to_2_63_minus_1_exact_and_refuses_2_63_naming_the_feature(
        served: ManagedServed) -> None:
    rebuilt = served.rebuilt()
    ref = Runtime.from_artifact(rebuilt, RuntimeConfig())
    names = [f.name for f in rebuilt.schema.features]
    feature = names[MANAGED[0]]
    held = rebuilt.id_maps[rebuilt.schema.tables[MANAGED[0]].name].to_numpy()[0]
    top = int(held[-1])   # the largest admitted id: 2**63-1 unless a delta evicted it
    assert top > 2**62, top

    def body(x: int) -> tuple[bytes, SparseBatch]:
        sparse = {n: [3] for n in names}
        sparse[feature] = [x]
        values = torch.tensor([sparse[n][0] for n in names], dtype=torch.int64)
        return (orjson.dumps({"instances": [{"dense": [0.5] * N, "sparse": sparse}]}),
                SparseBatch(values, torch.ones((F, 1), dtype=torch.int32)))

    dense = torch.full((1, N), 0.5)
    for x in (top, MAX):
        exact, exact_sparse = body(x)
        want = ref.predict(dense, exact_sparse)
        assert torch.equal(served.predict(exact, "application/json"), want), x
    # A float round trip (float64 keeps 53 bits) would turn ``top`` into another id,
    # one without a row: the fallback, a different score.
    exact, exact_sparse = body(top)
    rounded = min(int(float(top)), MAX)
    assert rounded != top and rounded not in set(held.tolist())
    assert not torch.equal(ref.predict(dense, exact_sparse), ref.predict(dense, body(rounded)[1])), \
        "the admitted id and its float rounding score the same: the test could not fail"
    for bad in (2**63, 2**64 - 1):
        text = orjson.dumps({"instances": [{"dense": [0.5] * N, "sparse": {
            **{n: [3] for n in names}, feature: [bad]}}]})
        r = served.post(text, "application/json")
        assert r.status_code == 400, r.text
        msg = r.json()["message"]
        assert f"sparse.{feature}[0]" in msg and str(bad) in msg and "2^63-1" in msg, msg


def test_managed_state_and_metrics_show_the_id_maps_after_admit_and_evict(
        served: ManagedServed) -> None:
    served.ensure_deltas()
    rebuilt = served.rebuilt()
    emb = served.state()["embeddings"][VERSION]
    assert emb["applied_sequence"] == len(served.deltas) == 2
    m = served.metrics()
    fallback = _fallback_counter(m)
    by_feature = {x["feature"]: x for x in emb["id_maps"]}
    schema = rebuilt.schema
    want_features = {f.name for f, t in zip(schema.features, schema.feature_tables, strict=True)
                     if schema.tables[t].mapping == "managed"}
    assert set(by_feature) == want_features and len(want_features) == len(MANAGED)
    for f, t in zip(schema.features, schema.feature_tables, strict=True):
        spec = schema.tables[t]
        if spec.mapping != "managed":
            continue
        got = by_feature[f.name]
        admitted = sum(int(d.tables[i].assign_ids.size) for d in served.deltas
                       for i in range(len(d.tables)) if d.tables[i].table == t)
        evicted = sum(int(d.tables[i].evict_ids.size) for d in served.deltas
                      for i in range(len(d.tables)) if d.tables[i].table == t)
        size = rebuilt.id_maps[spec.name].size
        assert got == {"feature": f.name, "table": spec.name, "capacity": spec.rows - 1,
                       "ids": size, "occupancy": pytest.approx(size / (spec.rows - 1)),
                       "admitted": admitted, "evicted": evicted, "sequence": 2,
                       "fallback_lookups": int(fallback.get(f.name, 0))}, f.name
        assert m[("dlrm_embedding_id_map_occupancy_ratio",
                  (("feature", f.name), ("version", VERSION)))] == pytest.approx(
            size / (spec.rows - 1))
        lab = (("feature", f.name),)
        assert m.get(("dlrm_embedding_ids_admitted_total", lab), 0.0) == admitted
        assert m.get(("dlrm_embedding_ids_evicted_total", lab), 0.0) == evicted
