"""Managed id spaces, the serving side without TorchServe: the workers' fallback counter
(``dlrm_embedding_ids_fallback_total``), the sidecar's admitted/evicted counters (once per
pod, when a delta is stored), each served version's id maps (GET /state
``embeddings.<version>.id_maps``) and the occupancy gauge, computed from the build report
and the stored deltas' headers."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from bench.gpu_check import build_random_artifact
from serve.api.binary import encode_binary
from serve.api.config import HandlerConfig
from serve.api.request import BINARY_MEDIA_TYPE
from serve.metrics import EMBEDDING_IDS_FALLBACK_TOTAL
from serve.metrics.aggregate import feature_counts
from serve.metrics.deltas import IdMapGauge, embedding_id_families
from serve.metrics.worker import HandlerMetrics
from serve.runtime.artifact import Artifact
from serve.runtime.engine import Runtime, RuntimeConfig
from serve.runtime.idmap import FALLBACK_ROW
from serve.sidecar.services.deltas.parts import DeltaParts
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import version_digest
from serve.store.deltas.status import WorkerStatus
from serve.worker import Worker, WorkerRequest
from tests.fixtures.deltas import add_delta, chained, delta_parts, with_delta_rows
from tests.fixtures.idmaps import MANAGED, VERSION, id_delta, managed_copy, raw_batch

F = 26


@pytest.fixture(scope="module")
def base() -> Artifact:
    return build_random_artifact("tiny", torch.device("cpu"), seed=3)


@pytest.fixture(scope="module")
def managed(base: Artifact) -> Artifact:
    return managed_copy(base)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# -- the workers' fallback counter ---------------------------------------------------------

def test_managed_fallback_counter_moves_by_delta_of_cumulative_counts():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    names, managed = ["C1", "C2", "C3"], frozenset({"C1", "C3"})

    def value(feature: str, version: str = "v1") -> float | None:
        return _value(reg, EMBEDDING_IDS_FALLBACK_TOTAL, feature=feature, version=version)

    m.set_fallback("v1", names, (0, 0, 0), managed, count=False)
    assert value("C1") == 0.0 and value("C3") == 0.0
    assert value("C2") is None, "a modulo feature gets no fallback series"
    m.set_fallback("v1", names, (5, 9, 2), managed)
    m.set_fallback("v1", names, (7, 9, 2), managed)
    assert (value("C1"), value("C3")) == (7.0, 2.0)
    m.set_fallback("v1", names, (100, 0, 50), managed, count=False)   # warm-up: not counted
    m.set_fallback("v1", names, (101, 0, 50), managed)
    assert value("C1") == 8.0
    m.set_fallback("v1", names, (3, 0, 1), managed)   # a rebuilt runtime counts from 0
    assert (value("C1"), value("C3")) == (11.0, 3.0)
    m.set_fallback("v2", names, (4, 0, 0), managed)   # a rollout's candidate: its own series
    assert (value("C1", "v2"), value("C1")) == (4.0, 11.0)


def test_managed_worker_records_fallback_lookups_per_feature(managed, base):
    reg = CollectorRegistry()
    rt = Runtime.from_artifact(managed, RuntimeConfig(cache_on_cpu=True, cache_load_factor=0.2))
    w = Worker(rt, HandlerConfig(max_instances=1024), model_version=VERSION,
               metrics=HandlerMetrics(reg))
    names = rt.feature_names
    managed_names = {names[t] for t in MANAGED}
    assert {n for n in names if _value(reg, EMBEDDING_IDS_FALLBACK_TOTAL, feature=n,
                                       version=VERSION) == 0.0} == managed_names, \
        "series at 0 for managed features from the start"
    dense, sparse = raw_batch(managed, 5, 64, multi_hot=True, unknown=0.3)
    body = encode_binary(dense.numpy(), sparse.lengths.numpy(), sparse.values.numpy())
    out = w.handle([WorkerRequest(body, BINARY_MEDIA_TYPE)])
    assert out[0].status == 200, out[0].body
    bounds = [0, *np.cumsum(sparse.lengths.sum(1).tolist()).tolist()]
    for t in MANAGED:
        v = sparse.values[bounds[t]:bounds[t + 1]]
        want = int((managed.id_maps[managed.schema.tables[t].name].lookup(v)
                    == FALLBACK_ROW).sum())
        assert _value(reg, EMBEDDING_IDS_FALLBACK_TOTAL, feature=names[t],
                      version=VERSION) == want, names[t]
    assert sum(_value(reg, EMBEDDING_IDS_FALLBACK_TOTAL, feature=names[t],
                      version=VERSION) or 0 for t in MANAGED) > 0
    # a modulo model: no fallback series at all
    reg2 = CollectorRegistry()
    w2 = Worker(Runtime.from_artifact(base, RuntimeConfig()), HandlerConfig(max_instances=1024),
                model_version="tiny-modulo", metrics=HandlerMetrics(reg2))
    w2.handle([WorkerRequest(encode_binary(dense.numpy(), sparse.lengths.numpy(),
                                           sparse.values.numpy() % 100), BINARY_MEDIA_TYPE)])
    assert all(_value(reg2, EMBEDDING_IDS_FALLBACK_TOTAL, feature=n, version="tiny-modulo")
               is None for n in names)
    assert not [f for f in reg2.collect() if f.name == "dlrm_embedding_ids_fallback"
                and f.samples]


def test_managed_feature_counts_sum_a_counter_by_feature():
    reg = CollectorRegistry()
    m = HandlerMetrics(reg)
    m.set_fallback("v1", ["C1", "C2"], (4, 6))
    m.set_fallback("v2", ["C1", "C2"], (1, 0))
    assert feature_counts(reg.collect(), EMBEDDING_IDS_FALLBACK_TOTAL) == {
        "v1": {"C1": 4, "C2": 6}, "v2": {"C1": 1, "C2": 0}}


def test_managed_id_families_are_bounded_and_named():
    fams = {f.name: f for f in embedding_id_families(
        {"C1": 3}, {"C1": 1, "C4": 2}, [IdMapGauge("v1", "C1", 0.25)])}
    admitted = fams["dlrm_embedding_ids_admitted"].samples
    assert [(s.name, s.labels, s.value) for s in admitted] == [
        ("dlrm_embedding_ids_admitted_total", {"feature": "C1"}, 3.0)]
    assert len(fams["dlrm_embedding_ids_evicted"].samples) == 2
    occ = fams["dlrm_embedding_id_map_occupancy_ratio"].samples
    assert [(s.labels, s.value) for s in occ] == [({"version": "v1", "feature": "C1"}, 0.25)]


# -- the sidecar: admitted / evicted once per pod, id maps per version ------------------------

def _report(art: Artifact, with_counts: bool = True) -> dict[str, Any]:
    r: dict[str, Any] = {"version": VERSION, "profile": "tiny", "quantized_dtype": "int8",
                         "created_at": "2026-12-01T00:00:00+00:00",
                         "schema": art.schema.to_dict()}
    if with_counts:
        r["id_mapping"] = {"mapping": "managed", "policy": "test", "threshold": 1, "tables": {
            n: {"admitted": m.size, "capacity": m.capacity, "occupancy": m.occupancy}
            for n, m in art.id_maps.items()}}
    return r


def _service(tmp_path: Path, report: dict[str, Any],
             fallback: dict[str, dict[str, int]] | None = None) -> DeltaParts:
    return delta_parts(DeltaStore(tmp_path / "deltas"), versions=lambda: [VERSION],
                       report_of=lambda v: report,
                       fallback_counts=(lambda: dict(fallback)) if fallback is not None
                       else None)


def _two_deltas(art: Artifact) -> list[tuple[bytes, Any]]:
    d1 = id_delta(art, 11, 1)
    d2 = id_delta(with_delta_rows(art, d1), 12, 2, tables=(0, 2), modulo_tables=(4,))
    return chained([d1, d2], parent=version_digest(_report(art)))


def _per_feature(deltas: list[Any], attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in deltas:
        for t in d.tables:
            n = int(getattr(t, attr).shape[0])
            if n:
                out[t.feature] = out.get(t.feature, 0) + n
    return out


def test_managed_admitted_and_evicted_are_counted_once_per_stored_delta(managed, tmp_path):
    svc = _service(tmp_path, _report(managed))
    chain = _two_deltas(managed)
    for blob, _ in chain:
        assert add_delta(svc.intake, blob).outcome == "stored"
    assert add_delta(svc.intake, chain[0][0]).outcome == "unchanged"   # the same bytes again: not counted
    deltas = [d for _, d in chain]
    assert svc.intake.ids.admitted == _per_feature(deltas, "assign_ids") != {}
    assert svc.intake.ids.evicted == _per_feature(deltas, "evict_ids") != {}


def test_managed_id_maps_follow_the_deltas_every_worker_applied(managed, tmp_path):
    report = _report(managed)
    svc = _service(tmp_path, report, fallback={VERSION: {"C1": 17}, "other": {"C1": 5}})
    chain = _two_deltas(managed)
    for blob, _ in chain:
        add_delta(svc.intake, blob)
    deltas = [d for _, d in chain]
    schema = managed.schema
    for applied in (0, 1, 2):
        svc.store.write_worker_status(WorkerStatus(101, VERSION, applied, 0, 0.0, 0.0, 0.0))
        svc.store.write_worker_status(WorkerStatus(102, VERSION, 2, 0, 0.0, 0.0, 0.0))
        got = svc.report.summary(VERSION, [101, 102], fallback={"C1": 17}).id_maps
        rebuilt = with_delta_rows(managed, *deltas[:applied])
        assert [m.feature for m in got] == [schema.features[t].name for t in MANAGED]
        for m, t in zip(got, MANAGED, strict=True):
            spec = schema.tables[t]
            size = rebuilt.id_maps[spec.name].size
            assert (m.table, m.capacity, m.ids, m.sequence) == (spec.name, spec.rows - 1,
                                                                 size, applied)
            assert m.occupancy == pytest.approx(size / (spec.rows - 1))
            ts = [x for d in deltas[:applied] for x in d.tables if x.table == t]
            assert m.admitted == sum(int(x.assign_ids.shape[0]) for x in ts)
            assert m.evicted == sum(int(x.evict_ids.shape[0]) for x in ts)
            assert m.fallback_lookups == (17 if m.feature == "C1" else 0)
    # GET /state's path: the version's own counts from {version: {feature: n}}
    got = asyncio.run(svc.report.summaries())[VERSION].id_maps
    assert [m.fallback_lookups for m in got] == [17 if m.feature == "C1" else 0 for m in got]
    # No worker reports: the stored deltas (what the workers will apply).
    fresh = _service(tmp_path, report)
    maps = fresh.report.summary(VERSION, []).id_maps    # read from the files (a restarted sidecar)
    rebuilt = with_delta_rows(managed, *deltas)
    assert [m.ids for m in maps] == [rebuilt.id_maps[schema.tables[t].name].size
                                     for t in MANAGED]
    assert all(m.fallback_lookups is None and m.sequence == 2 for m in maps)
    js = fresh.report.summary(VERSION, []).to_json()["id_maps"][0]
    assert set(js) == {"feature", "table", "capacity", "ids", "occupancy", "admitted",
                       "evicted", "sequence", "fallback_lookups"}


def test_managed_id_maps_without_build_counts_say_null_not_zero(managed, tmp_path):
    svc = _service(tmp_path, _report(managed, with_counts=False))
    maps = svc.report.summary(VERSION, []).id_maps
    assert len(maps) == len(MANAGED)
    assert all(m.ids is None and m.occupancy is None and m.capacity > 0 for m in maps)
    fams = {f.name: f for f in svc.report.collect()}
    assert fams["dlrm_embedding_id_map_occupancy_ratio"].samples == []


def test_managed_id_maps_are_empty_for_a_modulo_version(base, tmp_path):
    report = {"version": VERSION, "profile": "tiny", "quantized_dtype": "int8",
              "schema": base.schema.to_dict()}
    svc = _service(tmp_path, report)
    summary = svc.report.summary(VERSION, [])
    assert summary.id_maps == () and summary.to_json()["id_maps"] == []


def test_managed_occupancy_gauge_and_counters_at_scrape(managed, tmp_path):
    svc = _service(tmp_path, _report(managed))
    chain = _two_deltas(managed)
    for blob, _ in chain:
        add_delta(svc.intake, blob)
    svc.store.write_worker_status(WorkerStatus(7, VERSION, 2, 0, 0.0, 0.0, 0.0))

    async def pids() -> list[int]:
        return [7]

    svc.progress.set_live_pids(pids)
    asyncio.run(svc.progress.live_pids())
    fams = {f.name: f for f in svc.report.collect()}
    rebuilt = with_delta_rows(managed, *[d for _, d in chain])
    occ = {s.labels["feature"]: s.value
           for s in fams["dlrm_embedding_id_map_occupancy_ratio"].samples}
    schema = managed.schema
    assert occ == {schema.features[t].name: pytest.approx(
        rebuilt.id_maps[schema.tables[t].name].occupancy) for t in MANAGED}
    assert {s.labels["version"] for s in fams["dlrm_embedding_id_map_occupancy_ratio"].samples
            } == {VERSION}
    admitted = {s.labels["feature"]: s.value for s in fams["dlrm_embedding_ids_admitted"].samples}
    assert admitted == {k: float(v) for k, v in
                        _per_feature([d for _, d in chain], "assign_ids").items()}
