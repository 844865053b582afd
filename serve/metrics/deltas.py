"""The sidecar's embedding-delta families, computed at scrape from what the delta service
holds (:mod:`serve.sidecar.services.deltas`): per served version the delta
gauges, the managed-id counters and occupancy, and the files and POSTs not taken, by
bounded reason. Names in :mod:`serve.metrics`.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from serve.metrics import (
    DELTA_FILES_SKIPPED_TOTAL,
    DELTA_POSTS_REFUSED_TOTAL,
    DELTA_REFUSAL_REASONS,
    DELTA_SKIP_REASONS,
    EMBEDDING_DELTA_APPLIED_SEQUENCE,
    EMBEDDING_DELTA_APPLY_SECONDS,
    EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS,
    EMBEDDING_DELTA_ROWS_UPDATED,
    EMBEDDING_DELTA_SEQUENCE,
    EMBEDDING_ID_MAP_OCCUPANCY_RATIO,
    EMBEDDING_IDS_ADMITTED_TOTAL,
    EMBEDDING_IDS_EVICTED_TOTAL,
)

__all__ = [
    "EmbeddingDeltaGauges",
    "IdMapGauge",
    "delta_files_skipped_family",
    "delta_posts_refused_family",
    "embedding_delta_families",
    "embedding_id_families",
]


@dataclass(frozen=True)
class EmbeddingDeltaGauges:
    """One served version's embedding-delta state at a scrape (``serve.sidecar.services.deltas``).

    ``None`` leaves that version's series out of the family: no live worker reports
    (``applied_sequence``, ``rows_updated``, ``apply_seconds``) or no delta applied by
    every live worker yet (``created_at``), rather than a made-up 0.
    """

    version: str
    last_sequence: int
    applied_sequence: int | None = None
    rows_updated: int | None = None
    apply_seconds: float | None = None
    created_at: float | None = None


def embedding_delta_families(gauges: Iterable[EmbeddingDeltaGauges]) -> list[Metric]:
    """The embedding-delta gauges, labelled ``{version}`` (served versions only: bounded).

    * ``dlrm_embedding_delta_sequence``: the last delta sequence the pod stored.
    * ``dlrm_embedding_delta_applied_sequence``: the last one every live worker serving the
      version has applied (their minimum); below the stored one while workers catch up.
    * ``dlrm_embedding_delta_rows_updated``: embedding rows written by the deltas applied
      (the slowest worker's count).
    * ``dlrm_embedding_delta_apply_seconds``: the slowest live worker's last apply time.
    * ``dlrm_embedding_delta_created_timestamp_seconds``: unix time the newest delta
      applied by every live worker was built; ``time() - it`` is the staleness the
      ``DlrmEmbeddingDeltasStale`` alert watches.
    """
    rows = list(gauges)
    specs: list[tuple[str, str, str]] = [
        (EMBEDDING_DELTA_SEQUENCE, "last_sequence",
         "Last embedding delta sequence number the pod stored for the version."),
        (EMBEDDING_DELTA_APPLIED_SEQUENCE, "applied_sequence",
         "Last embedding delta sequence every live worker serving the version applied."),
        (EMBEDDING_DELTA_ROWS_UPDATED, "rows_updated",
         "Embedding rows written by the deltas every live worker applied (slowest worker)."),
        (EMBEDDING_DELTA_APPLY_SECONDS, "apply_seconds",
         "Seconds the slowest live worker's last delta apply took (batch wait excluded)."),
        (EMBEDDING_DELTA_CREATED_TIMESTAMP_SECONDS, "created_at",
         "Unix time the newest delta applied by every live worker was built."),
    ]
    out: list[Metric] = []
    for name, attr, doc in specs:
        family = GaugeMetricFamily(name, doc, labels=["version"])
        for g in rows:
            value = getattr(g, attr)
            if value is not None:
                family.add_metric([g.version], float(value))
        out.append(family)
    return out


@dataclass(frozen=True)
class IdMapGauge:
    """One managed feature's id-map occupancy in one served version (0..1)."""

    version: str
    feature: str
    occupancy: float


def embedding_id_families(admitted: Mapping[str, int], evicted: Mapping[str, int],
                          occupancy: Iterable[IdMapGauge]) -> list[Metric]:
    """The sidecar's managed-id families (``serve.sidecar.services.deltas``).

    * ``dlrm_embedding_ids_admitted_total{feature}`` / ``..._evicted_total{feature}``:
      ids the deltas this pod stored assigned a row / evicted (each delta counted once,
      when stored). A feature appears once a delta named it (0 until then is not made
      up: no series).
    * ``dlrm_embedding_id_map_occupancy_ratio{version,feature}``: admitted ids / capacity
      of each managed feature's table in each served version (``version`` is one of the
      served versions: bounded, like the delta gauges).
    """
    out: list[Metric] = []
    for name, doc, counts in (
            (EMBEDDING_IDS_ADMITTED_TOTAL, ("Ids of managed tables admitted (assigned a row) "
             "by the embedding deltas this pod stored, per feature."), admitted),
            (EMBEDDING_IDS_EVICTED_TOTAL, ("Ids of managed tables evicted (back to the "
             "fallback row) by the embedding deltas this pod stored, per feature."), evicted)):
        family = CounterMetricFamily(name, doc, labels=["feature"])
        for feature in sorted(counts):
            family.add_metric([feature], float(counts[feature]))
        out.append(family)
    gauge = GaugeMetricFamily(
        EMBEDDING_ID_MAP_OCCUPANCY_RATIO,
        "Admitted ids / capacity (rows - 1) of a managed feature's id map in a served "
        "version: the build's ids plus the applied deltas' admissions minus evictions.",
        labels=["version", "feature"])
    for g in occupancy:
        gauge.add_metric([g.version, g.feature], float(g.occupancy))
    out.append(gauge)
    return out


def delta_files_skipped_family(counts: Mapping[str, int]) -> Metric:
    """``dlrm_delta_files_skipped_total{reason}``: every reason of
    :data:`DELTA_SKIP_REASONS`, 0 when none (bounded labels; others are dropped)."""
    family = CounterMetricFamily(
        DELTA_FILES_SKIPPED_TOTAL,
        "Embedding-delta files on the model volume not taken, by reason (each file once).",
        labels=["reason"])
    for reason in DELTA_SKIP_REASONS:
        family.add_metric([reason], float(counts.get(reason, 0)))
    return family


def delta_posts_refused_family(counts: Mapping[str, int]) -> Metric:
    """``dlrm_delta_posts_refused_total{reason}``: every reason of
    :data:`DELTA_REFUSAL_REASONS`, 0 when none (others are counted as ``other``)."""
    family = CounterMetricFamily(
        DELTA_POSTS_REFUSED_TOTAL,
        "POST /embeddings/deltas refused (nothing stored), by reason.", labels=["reason"])
    known = {r: float(counts.get(r, 0)) for r in DELTA_REFUSAL_REASONS}
    known["other"] += float(sum(n for r, n in counts.items() if r not in known))
    for reason, value in known.items():
        family.add_metric([reason], value)
    return family
