"""What the pod holds and what its workers applied, per served version: :class:`DeltaReport`.

GET /state and GET /embeddings/deltas read :meth:`DeltaReport.summaries` (and
:meth:`DeltaReport.damaged`: a stored delta truncated on a crash or changed on the disk
is named rather than blocking its version silently). The report is also the Prometheus
collector of the delta families (:func:`serve.metrics.deltas.embedding_delta_families`, the
managed-id families, the refusal and skip counters), computed at scrape from the store,
the live workers' status files and the intake's counts; an unreadable file is skipped
and never fails a scrape.

It only reads: the store, :class:`~serve.sidecar.services.deltas.progress.WorkerProgress`
(the live pids) and the intake's counts and id ledger.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from serve.errors import ServeError
from serve.metrics.deltas import (
    EmbeddingDeltaGauges,
    IdMapGauge,
    delta_files_skipped_family,
    delta_posts_refused_family,
    embedding_delta_families,
    embedding_id_families,
)
from serve.sidecar.services.deltas.idmaps import IdMaps, IdMapStatus
from serve.sidecar.services.deltas.intake import DeltaIntake
from serve.sidecar.services.deltas.progress import WorkerProgress
from serve.store.deltas.status import WorkerStatus

__all__ = ["DeltaReport", "VersionSummary"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionSummary:
    """One served version's deltas: stored, and applied by its live workers.

    ``applied_sequence`` is the minimum over the live workers serving the version, and the
    other applied-side values are those of that slowest worker (``rows_updated``,
    ``newest_delta_created_at``) or the maximum over workers (``apply_seconds_max``); all
    are None when no live worker reports. ``newest_delta_created_at`` is also None while
    that worker has applied no delta (sequence 0).

    ``head_digest`` is what the version's next delta must name as its ``parent_digest``:
    the sha256 of its last stored delta, or the version's identity
    (:func:`serve.store.deltas.format.version_digest`) while none is stored; None when not
    computed (a metric scrape) or the report cannot be read.
    """

    version: str
    last_sequence: int
    applied_sequence: int | None
    rows_updated: int | None
    apply_seconds_max: float | None
    newest_delta_created_at: float | None
    newest_delta_age_s: float | None
    workers: tuple[WorkerStatus, ...]
    head_digest: str | None = None
    id_maps: tuple[IdMapStatus, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"last_sequence": self.last_sequence, "head_digest": self.head_digest,
                "id_maps": [m.to_json() for m in self.id_maps],
                "applied_sequence": self.applied_sequence,
                "rows_updated": self.rows_updated,
                "apply_seconds_max": self.apply_seconds_max,
                "newest_delta_created_at": self.newest_delta_created_at,
                "newest_delta_age_s": self.newest_delta_age_s,
                "workers": [w.to_json() for w in self.workers]}

    def gauges(self) -> EmbeddingDeltaGauges:
        return EmbeddingDeltaGauges(
            version=self.version, last_sequence=self.last_sequence,
            applied_sequence=self.applied_sequence, rows_updated=self.rows_updated,
            apply_seconds=self.apply_seconds_max, created_at=self.newest_delta_created_at)


class DeltaReport(Collector):
    """Reports the deltas of every served version (module docstring). Holds no state of
    its own beyond the id maps' report cache (:class:`IdMaps`, thread-safe).

    Args:
        intake: the pod's intake: its store, limit, counts and id ledger.
        progress: the live workers.
        versions: the versions the pod serves now (``Sidecar.served_versions``).
        report_of: a version's build report (``ModelRepository.report``).
        wall_clock: unix seconds, for the age of the newest applied delta.
        fallback_counts: the pod's fallback-row lookups, ``{version: {feature: n}}``
            (the workers' ``dlrm_embedding_ids_fallback_total``), for GET /state's
            ``id_maps``; None: unknown (``fallback_lookups`` null).
    """

    def __init__(self, intake: DeltaIntake, progress: WorkerProgress, *,
                 versions: Callable[[], list[str]],
                 report_of: Callable[[str], dict[str, Any]],
                 wall_clock: Callable[[], float] = time.time,
                 fallback_counts: Callable[[], dict[str, dict[str, int]]] | None = None
                 ) -> None:
        self.intake = intake
        self.store = intake.store
        self.progress = progress
        self.wall_clock = wall_clock
        self.fallback_counts = fallback_counts
        self.id_maps = IdMaps(intake.ids, report_of)
        self._versions = versions

    def head_digest(self, version: str) -> str | None:
        """What the next delta of ``version`` must name as its parent (blocking reads):
        the digest of its last stored delta, else the version's identity; None when the
        report cannot be read."""
        try:
            last = self.store.last_sequence(version)
            return self.store.digest(version, last) if last else self.intake.base_digest(version)
        except (OSError, ValueError, ServeError) as e:
            _log.warning("the head digest of %s's deltas cannot be read: %s", version, e)
            return None

    def summary(self, version: str, pids: Iterable[int], *, digest: bool = True,
                fallback: dict[str, int] | None = None) -> VersionSummary:
        """``version``'s stored and applied deltas and its managed id maps (blocking file
        reads); ``digest``: with its ``head_digest`` (a scrape leaves it out);
        ``fallback``: the pod's fallback lookups of ``version`` per feature, for the id
        maps."""
        workers = tuple(self.store.worker_statuses(version, sorted(set(pids))))
        last = self.store.last_sequence(version)
        head = self.head_digest(version) if digest else None
        through = min((w.sequence for w in workers), default=last)
        try:
            maps = self.id_maps.of(version, min(through, last), fallback)
        except (OSError, ValueError, KeyError, ServeError) as e:
            _log.warning("id maps of version %s not described: %s", version, e)
            maps = ()
        if not workers:
            return VersionSummary(version, last, None, None, None, None, None, (), head,
                                  maps)
        slowest = min(workers, key=lambda w: (w.sequence, w.rows))
        created = slowest.created_at if slowest.sequence > 0 and slowest.created_at > 0 \
            else None
        age = None if created is None else max(0.0, self.wall_clock() - created)
        return VersionSummary(
            version=version, last_sequence=last, applied_sequence=slowest.sequence,
            rows_updated=slowest.rows,
            apply_seconds_max=max(float(w.apply_seconds) for w in workers),
            newest_delta_created_at=created, newest_delta_age_s=age, workers=workers,
            head_digest=head, id_maps=maps)

    async def summaries(self) -> dict[str, VersionSummary]:
        """Each served version's :class:`VersionSummary` (GET /state, GET
        /embeddings/deltas)."""
        pids = await self.progress.live_pids()
        versions = self._versions()

        def read() -> dict[str, VersionSummary]:
            counts = None
            if self.fallback_counts is not None:
                try:
                    counts = self.fallback_counts()
                except Exception as e:  # noqa: BLE001 - a status read must not fail on it
                    _log.warning("fallback lookups unknown: %s", e)
            return {v: self.summary(v, pids, fallback=None if counts is None
                                    else counts.get(v, {})) for v in versions}

        return await asyncio.to_thread(read)

    async def damaged(self) -> dict[str, list[tuple[str, str]]]:
        """Per served version, each damaged stored delta (file name, reason): a truncated
        or changed file the workers cannot apply (they stop there). Re-posting the right
        bytes repairs it. Checksums are cached per file version (not re-read per GET)."""
        versions = self._versions()
        max_bytes = self.intake.max_bytes
        got = await asyncio.to_thread(
            lambda: {v: self.store.damaged(v, max_bytes) for v in versions})
        return {v: d for v, d in got.items() if d}

    def collect(self) -> Iterator[Metric]:
        """The delta families of every served version (module docstring)."""
        try:
            versions = self._versions()
        except Exception as e:  # noqa: BLE001 - never fail a scrape
            _log.warning("embedding delta metrics: served versions unknown: %s", e)
            versions = []
        pids = self.progress.pids_for_scrape() if versions else frozenset()
        gauges, occupancy = [], []
        for version in versions:
            try:
                summary = self.summary(version, pids, digest=False)
            except (OSError, ValueError, ServeError) as e:
                _log.warning("embedding delta metrics of %s skipped: %s", version, e)
                continue
            gauges.append(summary.gauges())
            occupancy += [IdMapGauge(version, m.feature, m.occupancy)
                          for m in summary.id_maps if m.occupancy is not None]
        yield from embedding_delta_families(gauges)
        yield from embedding_id_families(self.intake.ids.admitted, self.intake.ids.evicted,
                                         occupancy)
        yield delta_files_skipped_family(self.intake.skipped.counts())
        yield delta_posts_refused_family(self.intake.refused.counts())
