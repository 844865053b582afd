"""What the sidecar re-exposes of others: the workers' multiprocess files summed over
processes (:class:`HandlerAggregateCollector`, plus the derived ``dlrm_cache_hit_ratio``),
the worker count by status (:func:`workers_family`) and TorchServe's own metrics
(:func:`torchserve_families`). Names in :mod:`serve.metrics`.
"""
from __future__ import annotations

import logging
import math
import os
import re
import threading
from collections import Counter as _Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.metrics_core import (
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from serve.metrics import (
    CACHE_HIT_RATIO,
    CACHE_HITS_TOTAL,
    CACHE_MISSES_TOTAL,
    TIER_CAPACITY_BYTES,
    TIER_HITS_TOTAL,
    TIER_LOOKUPS_TOTAL,
    TIER_MISS_SECONDS,
    TIER_READ_BYTES_TOTAL,
    TIERS,
    TORCHSERVE_PREFIX,
    WORKERS,
    strip_total,
)

__all__ = [
    "HandlerAggregateCollector",
    "TierTotals",
    "cache_hit_ratio_family",
    "feature_counts",
    "tier_totals",
    "torchserve_families",
    "workers_family",
]

_log = logging.getLogger(__name__)


def _family_total(families: Iterable[Metric], name: str) -> float | None:
    family = strip_total(name)
    for metric in families:
        if metric.name == family:
            return sum(s.value for s in metric.samples if s.name == name)
    return None


def feature_counts(families: Iterable[Metric], name: str) -> dict[str, dict[str, int]]:
    """The samples of counter ``name`` (e.g. :data:`EMBEDDING_IDS_FALLBACK_TOTAL`) in
    ``families`` summed by their ``version`` and ``feature`` labels (the workers' files,
    summed over processes: :meth:`HandlerAggregateCollector.collect`):
    ``{version: {feature: count}}``."""
    family = strip_total(name)
    out: dict[str, dict[str, int]] = {}
    for metric in families:
        if metric.name != family:
            continue
        for s in metric.samples:
            feature, version = s.labels.get("feature"), s.labels.get("version")
            if s.name == name and feature is not None and version is not None:
                per = out.setdefault(version, {})
                per[feature] = per.get(feature, 0) + int(s.value)
    return out


@dataclass
class TierTotals:
    """One table tier's series summed over the workers' files (cumulative; labels
    ``tier`` in :data:`TIERS`): ids looked up and found there, bytes read from the tier
    below, its capacity (live workers' sum), and its miss-fetch histogram
    (``miss_buckets``: cumulative count per finite ``le`` bound, seconds; ``miss_count``
    the ``+Inf`` bucket)."""

    lookups: float = 0.0
    hits: float = 0.0
    read_bytes: float = 0.0
    capacity_bytes: float | None = None
    miss_buckets: dict[float, float] = field(default_factory=dict)
    miss_count: float = 0.0


_TIER_SAMPLES = {TIER_LOOKUPS_TOTAL: "lookups", TIER_HITS_TOTAL: "hits",
                 TIER_READ_BYTES_TOTAL: "read_bytes"}


def tier_totals(families: Iterable[Metric]) -> dict[str, TierTotals]:
    """The tier series in ``families`` (the workers' files summed over processes:
    :meth:`HandlerAggregateCollector.collect`) per tier; a tier no worker reports is
    absent (all tables in memory and no cache: ``{}``)."""
    out: dict[str, TierTotals] = {}
    bucket = f"{TIER_MISS_SECONDS}_bucket"
    for metric in families:
        for s in metric.samples:
            tier = s.labels.get("tier")
            if tier not in TIERS:
                continue
            attr = _TIER_SAMPLES.get(s.name)
            if attr is not None:
                t = out.setdefault(tier, TierTotals())
                setattr(t, attr, getattr(t, attr) + s.value)
            elif s.name == TIER_CAPACITY_BYTES:
                t = out.setdefault(tier, TierTotals())
                t.capacity_bytes = (t.capacity_bytes or 0.0) + s.value
            elif s.name == bucket:
                t = out.setdefault(tier, TierTotals())
                le = float(s.labels.get("le", "nan"))
                if math.isinf(le):
                    t.miss_count += s.value
                elif not math.isnan(le):
                    t.miss_buckets[le] = t.miss_buckets.get(le, 0.0) + s.value
    return out


def cache_hit_ratio_family(families: Iterable[Metric]) -> GaugeMetricFamily:
    """``dlrm_cache_hit_ratio`` = hits / (hits + misses) summed over ``families``
    (NaN before any lookup: 0/0 is unknown, not 0)."""
    families = list(families)
    hits = _family_total(families, CACHE_HITS_TOTAL) or 0.0
    misses = _family_total(families, CACHE_MISSES_TOTAL) or 0.0
    ratio = hits / (hits + misses) if hits + misses > 0 else math.nan
    return GaugeMetricFamily(
        CACHE_HIT_RATIO,
        "Embedding cache hits / lookups over the lifetime of all workers (0..1); "
        "computed by the sidecar from the summed counters.",
        value=ratio)


class HandlerAggregateCollector(Collector):
    """The workers' metrics summed over processes, plus ``dlrm_cache_hit_ratio``.

    Args:
        multiproc_dir: the workers' ``PROMETHEUS_MULTIPROC_DIR``. A missing directory
            yields no worker metrics (logged once) rather than failing the scrape.

    :meth:`reap` removes the live-gauge files of workers that have gone, given the pids
    TorchServe lists now. A pid is reaped only once it was seen alive and then vanished:
    a just-started worker may write before TorchServe lists it, and deleting its file
    would lose its gauges for good. Pids from TorchServe (not ``os.kill``) keep this
    right when the sidecar runs in another container with its own pid namespace.
    """

    def __init__(self, multiproc_dir: str | os.PathLike[str]) -> None:
        self.path = Path(multiproc_dir)
        self._seen: set[int] = set()
        self._warned = False
        self._lock = threading.Lock()

    def reap(self, live_pids: Iterable[int]) -> list[int]:
        """Forget workers TorchServe no longer lists; returns the pids reaped."""
        live = set(live_pids)
        with self._lock:
            gone = sorted(self._seen - live)
            self._seen = (self._seen & live) | live
        if self.path.is_dir():
            for pid in gone:
                mark_process_dead(pid, str(self.path))
        return gone

    def forget(self, pids: Iterable[int]) -> None:
        """Drop the live gauges of workers known to be gone (an unregistered version's),
        whether or not a scrape ever saw them."""
        pids = set(pids)
        with self._lock:
            self._seen -= pids
        if self.path.is_dir():
            for pid in pids:
                mark_process_dead(pid, str(self.path))

    def collect(self) -> Iterator[Metric]:
        if not self.path.is_dir():
            if not self._warned:
                self._warned = True
                _log.warning("multiprocess dir %s does not exist; no handler metrics",
                             self.path)
            families: list[Metric] = []
        else:
            families = list(MultiProcessCollector(None, path=str(self.path)).collect())
        yield from families
        yield cache_hit_ratio_family(families)


def workers_family(statuses: Iterable[str]) -> GaugeMetricFamily:
    """``dlrm_workers{status}``: TorchServe workers of all versions of the model, by
    status (``READY``, ``WORKER_STARTED``, ...); a READY series is always present."""
    tally = _Tally(str(s) for s in statuses)
    tally.setdefault("READY", 0)
    family = GaugeMetricFamily(
        WORKERS, "TorchServe workers of the model (all versions), by status.",
        labels=["status"])
    for status, count in sorted(tally.items()):
        family.add_metric([status], count)
    return family


_VALID_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


#: The label TorchServe puts the (serving) version in.
TS_VERSION_LABEL = "model_version"


def torchserve_families(text: str, prefix: str = TORCHSERVE_PREFIX,
                        version_of: Callable[[str], str] | None = None) -> list[Metric]:
    """TorchServe's Prometheus text (its metrics port) as families to re-expose.

    Names lacking ``prefix`` get it, so nothing collides with ``dlrm_`` names.
    ``version_of``: maps each sample's ``model_version`` (TorchServe's registration: one
    per serving version, a new one at every batching switch, kept by TorchServe for its
    lifetime) to the value re-exposed, e.g. the model version it serves; samples that then
    share every label are merged: counters summed (each registration's count stays
    cumulative, so the sum is too), other types keep the last. So the series do not grow
    per serving version. None: labels as TorchServe gives them.
    Raises ``ValueError`` when ``text`` is not Prometheus exposition.
    """
    out: list[Metric] = []
    for family in text_string_to_metric_families(text):
        name = family.name if family.name.startswith(prefix) else prefix + family.name
        if not _VALID_NAME.fullmatch(name):
            continue
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], list] = {}
        for s in family.samples:
            labels = dict(s.labels)
            if version_of is not None and TS_VERSION_LABEL in labels:
                labels[TS_VERSION_LABEL] = version_of(labels[TS_VERSION_LABEL])
            key = (name + s.name[len(family.name):], tuple(sorted(labels.items())))
            seen = merged.get(key)
            if seen is not None and family.type == "counter":
                seen[1] += s.value
            else:
                merged[key] = [labels, s.value, s.timestamp, s.exemplar]
        renamed = Metric(name, family.documentation, family.type, family.unit)
        for (sample_name, _), (labels, value, timestamp, exemplar) in merged.items():
            renamed.add_sample(sample_name, labels, value, timestamp, exemplar)
        out.append(renamed)
    return out
