"""The sidecar's side of embedding deltas: accept one, wait for the workers, report them.

A posted delta (:mod:`serve.sidecar.http.routes_deltas`) is checked completely before the store
changes, in this order, and any failure leaves the store as it was:

1. the body size (413 over :data:`serve.store.delta_files.MAX_DELTA_BYTES`);
2. the file itself (:func:`serve.store.delta_files.decode_delta`: magic, header, sizes, checksum;
   400 naming the field);
3. its base version is one the pod serves now, the stable version or a rollout's
   candidate (409 naming both);
4. it fits that version's tables (:func:`serve.store.delta_files.check_layout` against the build
   report's profile and dtype; 400 naming the field);
5. its sequence is the version's next one (:meth:`serve.store.delta_files.DeltaStore.add`; 409 for a
   repeat or a gap).

Then the TorchServe workers apply it: each worker follows ``<delta_dir>/<version>/``,
applies new deltas in order between two batches and writes
``<delta_dir>/<version>/workers/<pid>.json`` (:class:`serve.store.delta_files.WorkerStatus`) after
each apply and once at start with sequence 0. The workers serving a version are the
status files of that version whose pid TorchServe lists as a worker now (a rollout's
worker serves both versions and writes one file for each); files of dead workers are
ignored. A delta is *applied* once at least one such worker reports, and every one of them
reports a sequence at least the delta's: with no worker reporting, nothing has applied it.

Live pids come from TorchServe's management API (:func:`serve.sidecar.adapters.torchserve.observe`),
cached for :attr:`DeltaService.pid_ttl_s` so that polling and scrapes do not hammer it;
tests inject their own source. When TorchServe does not answer, the last pids known are
used (none before the first answer).

The service is also the Prometheus collector of the delta gauges
(:func:`serve.metrics.embedding_delta_families`), computed at scrape from the store and the
live workers' status files; an unreadable file is skipped and never fails a scrape.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from serve.errors import DeltaConflict, PayloadTooLarge, ServeError
from serve.metrics import EmbeddingDeltaGauges, embedding_delta_families
from serve.store import delta_files as delta_format
from serve.store.delta_files import (
    Delta,
    DeltaStore,
    WorkerStatus,
    check_layout,
    decode_delta,
    layout_for_report,
)

__all__ = [
    "POLL_INTERVAL_S",
    "WAIT_DEFAULT_S",
    "WAIT_MAX_S",
    "Accepted",
    "DeltaService",
    "LivePids",
    "VersionSummary",
    "WaitResult",
]

_log = logging.getLogger(__name__)

# A delta file on the model volume: anything ending in its 8-digit sequence + ".delta".
_VOLUME_FILE = re.compile(r"(\d{8})\.delta$")

#: How often a POST waiting for the workers re-reads their status files (seconds).
POLL_INTERVAL_S = 0.05
#: Longest wait a POST may ask for (``wait_s``); past it the answer is 202 and the workers
#: still apply the delta.
WAIT_MAX_S = 300.0
#: Default ``wait_s`` of POST /embeddings/deltas.
WAIT_DEFAULT_S = 30.0

#: The live TorchServe worker pids, read now (raises UpstreamUnavailable when TorchServe
#: does not answer).
LivePids = Callable[[], Awaitable[Iterable[int]]]


@dataclass(frozen=True)
class Accepted:
    """A delta that passed every check and is stored."""

    version: str
    sequence: int
    rows: int
    bytes: int
    created_at: float


@dataclass(frozen=True)
class WaitResult:
    """How the wait for the workers ended: ``applied`` when every live worker serving the
    version (at least one) reports the sequence; ``workers`` their statuses at the end."""

    applied: bool
    workers: tuple[WorkerStatus, ...]
    waited_s: float


@dataclass(frozen=True)
class VersionSummary:
    """One served version's deltas: stored, and applied by its live workers.

    ``applied_sequence`` is the minimum over the live workers serving the version, and the
    other applied-side values are those of that slowest worker (``rows_updated``,
    ``newest_delta_created_at``) or the maximum over workers (``apply_seconds_max``); all
    are None when no live worker reports. ``newest_delta_created_at`` is also None while
    that worker has applied no delta (sequence 0).
    """

    version: str
    last_sequence: int
    applied_sequence: int | None
    rows_updated: int | None
    apply_seconds_max: float | None
    newest_delta_created_at: float | None
    newest_delta_age_s: float | None
    workers: tuple[WorkerStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return {"last_sequence": self.last_sequence,
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


class DeltaService(Collector):
    """Accepts embedding deltas into the pod's store and reports what the workers applied.

    Args:
        store: the pod's delta store (``--delta-dir``), shared with the workers.
        versions: the versions the pod serves now (``Sidecar.served_versions``).
        report_of: a version's build report (``ModelRepository.report``), for its tables.
        live_pids: the live TorchServe worker pids (default none until
            :meth:`set_live_pids` is called: the app connects it to TorchServe).
        clock: monotonic seconds, for the wait and the pid cache.
        wall_clock: unix seconds, for the age of the newest applied delta.
        sleep: awaited between two polls (tests pass a fake clock's).
        pid_ttl_s: how long a read of the live pids is reused.
    """

    def __init__(self, store: DeltaStore, *, versions: Callable[[], list[str]],
                 report_of: Callable[[str], dict[str, Any]],
                 live_pids: LivePids | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 pid_ttl_s: float = 1.0) -> None:
        self.store = store
        self._versions = versions
        self._report_of = report_of
        self._live_pids = live_pids
        self.clock = clock
        self.wall_clock = wall_clock
        self._sleep = sleep
        self.pid_ttl_s = pid_ttl_s
        self._pids: frozenset[int] | None = None
        self._pids_at = -math.inf
        self._pids_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state_lock = threading.Lock()
        self._sync_failed: set[Path] = set()
        self._synced = False      # a sync pass over the model volume has completed
        self._caught_up = False   # latched: the pod once had every stored delta applied

    # ------------------------------------------------------------------ live workers

    def set_live_pids(self, source: LivePids) -> None:
        """Read the live worker pids from ``source`` from now on (cache dropped)."""
        with self._state_lock:
            self._live_pids = source
            self._pids, self._pids_at = None, -math.inf

    async def live_pids(self, *, max_age_s: float | None = None) -> frozenset[int]:
        """The live TorchServe worker pids, read at most ``max_age_s`` (default
        :attr:`pid_ttl_s`) ago; the last ones known when TorchServe does not answer."""
        self._loop = asyncio.get_running_loop()
        if self._pids_lock is None:
            self._pids_lock = asyncio.Lock()
        age = self.pid_ttl_s if max_age_s is None else max_age_s
        async with self._pids_lock:
            if self._pids is not None and self.clock() - self._pids_at < age:
                return self._pids
            source = self._live_pids
            if source is None:
                return frozenset()
            try:
                pids = frozenset(int(p) for p in await source())
            except ServeError as e:
                _log.warning("live worker pids unavailable, using the last known (%s): %s",
                             sorted(self._pids or ()), e.message)
                return self._pids or frozenset()
            with self._state_lock:
                self._pids, self._pids_at = pids, self.clock()
            return pids

    def _pids_for_scrape(self, timeout_s: float = 2.0) -> frozenset[int]:
        """Live pids from a synchronous caller (a scrape runs ``generate_latest`` in a
        thread): refreshed on the app's loop when called off it, else the cached ones."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _on_loop(loop):
            try:
                fut = asyncio.run_coroutine_threadsafe(self.live_pids(), loop)
                return fut.result(timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - a scrape must not fail over this
                _log.warning("live worker pids not refreshed for a scrape: %s", e)
        with self._state_lock:
            return self._pids or frozenset()

    # ------------------------------------------------------------------ accept

    def check_size(self, size: int) -> None:
        """Raise :class:`~serve.errors.PayloadTooLarge` for a body over the limit."""
        limit = delta_format.MAX_DELTA_BYTES
        if size > limit:
            raise PayloadTooLarge(
                f"body: {size} bytes is over the {limit}-byte limit of one delta; split "
                f"the rows into several deltas (consecutive sequence numbers)")

    def validate(self, blob: bytes) -> Delta:
        """Every check of a posted delta (module docstring, steps 1-4); changes nothing.

        Raises:
            PayloadTooLarge: over :data:`serve.store.delta_files.MAX_DELTA_BYTES`.
            InvalidDelta: the file is damaged or does not fit the version's tables (400).
            DeltaConflict: its base version is not served here (409).
        """
        self.check_size(len(blob))
        delta = decode_delta(blob)
        served = self._versions()
        if delta.base_version not in served:
            raise DeltaConflict(
                "header.base_version",
                f"{delta.base_version!r} is not served by this pod, which serves "
                f"{served or 'no version (no desired state)'}; build the delta against "
                f"the stable version or the rollout's candidate (GET /state)")
        check_layout(delta, layout_for_report(self._report_of(delta.base_version)))
        return delta

    def add(self, blob: bytes) -> Accepted:
        """Validate ``blob`` and store it as its version's next delta (blocking I/O: run
        it in a thread).

        Raises:
            the errors of :meth:`validate`; DeltaConflict for a repeated or skipped
            sequence (the store is unchanged on every error).
        """
        delta = self.validate(blob)
        self.store.add(blob, delta)
        _log.info("embedding delta %s #%d stored (%d rows, %d bytes)", delta.base_version,
                  delta.sequence, delta.rows, len(blob))
        return Accepted(delta.base_version, delta.sequence, delta.rows, len(blob),
                        delta.created_at)

    # ------------------------------------------------------------------ model volume

    def sync(self, roots: Iterable[Path]) -> list[Accepted]:
        """Pick up deltas published on the model volume: for each served version, the
        files ``<root>/deltas/<version>/*<seq:08d>.delta`` (what ``make delta`` writes,
        e.g. ``dlrm-small-int8-s0-00000001.delta``) whose sequence is above the store's,
        in sequence order, through the same checks as a POST (:meth:`add`).

        This is how every pod of a Deployment gets the same deltas, including pods that
        start later (a new pod's store is empty: it replays the volume's deltas of its
        version before its workers' first batch settles). A file that fails a check is
        logged once and stops that version's sync there (later ones need it).
        """
        out: list[Accepted] = []
        for version in self._versions():
            last = self.store.last_sequence(version)
            found: dict[int, Path] = {}
            for root in roots:
                folder = Path(root) / "deltas" / version
                try:
                    names = sorted(os.listdir(folder))
                except OSError:
                    continue
                for name in names:
                    m = _VOLUME_FILE.search(name)
                    if m and int(m.group(1)) > last:
                        found.setdefault(int(m.group(1)), folder / name)
            for seq in sorted(found):
                if seq != last + 1:
                    break  # a gap on the volume: wait for the missing file
                path = found[seq]
                try:
                    accepted = self.add(path.read_bytes())
                except (ServeError, OSError) as e:
                    if path not in self._sync_failed:
                        self._sync_failed.add(path)
                        _log.error("embedding delta %s from the model volume not taken: %s",
                                   path, getattr(e, "message", e))
                    break
                _log.info("embedding delta %s #%d picked up from %s", version, seq, path)
                out.append(accepted)
                last = seq
        self._synced = True
        return out

    async def not_caught_up(self, need_sync: bool) -> str | None:
        """Why a starting pod is not ready yet as far as deltas go, or None.

        Until the pod first catches up: the model volume must have been read once
        (``need_sync``), and every live worker of each served version must have applied
        the store's last delta. Latched after that: a delta posted later, which the
        workers apply within their poll interval, never takes a serving pod out of the
        Service.
        """
        if self._caught_up:
            return None
        if need_sync and not self._synced:
            return ("the embedding deltas on the model volume have not been read yet; "
                    "ready within the sync interval")
        pids = await self.live_pids()
        for version in self._versions():
            last = await asyncio.to_thread(self.store.last_sequence, version)
            if last == 0:
                continue
            statuses = await asyncio.to_thread(self.store.worker_statuses, version, list(pids))
            applied = min((st.sequence for st in statuses), default=0)
            if applied < last:
                return (f"version {version}: its workers have applied embedding delta "
                        f"{applied} of {last}; ready once they have all")
        self._caught_up = True
        return None

    # ------------------------------------------------------------------ wait

    async def wait_applied(self, version: str, sequence: int, wait_s: float,
                           poll_s: float = POLL_INTERVAL_S) -> WaitResult:
        """Poll the live workers' statuses of ``version`` every ``poll_s`` until each (at
        least one) reports ``sequence`` or more, or ``wait_s`` passes (0: look once)."""
        start = self.clock()
        deadline = start + max(0.0, wait_s)
        while True:
            pids = await self.live_pids()
            workers = tuple(await asyncio.to_thread(self.store.worker_statuses, version,
                                                    sorted(pids)))
            done = bool(workers) and all(w.sequence >= sequence for w in workers)
            now = self.clock()
            if done or now >= deadline:
                return WaitResult(done, workers, max(0.0, now - start))
            await self._sleep(min(poll_s, deadline - now))

    # ------------------------------------------------------------------ report

    def summary(self, version: str, pids: Iterable[int]) -> VersionSummary:
        """``version``'s stored and applied deltas (blocking file reads)."""
        workers = tuple(self.store.worker_statuses(version, sorted(set(pids))))
        last = self.store.last_sequence(version)
        if not workers:
            return VersionSummary(version, last, None, None, None, None, None, ())
        slowest = min(workers, key=lambda w: (w.sequence, w.rows))
        created = slowest.created_at if slowest.sequence > 0 and slowest.created_at > 0 \
            else None
        age = None if created is None else max(0.0, self.wall_clock() - created)
        return VersionSummary(
            version=version, last_sequence=last, applied_sequence=slowest.sequence,
            rows_updated=slowest.rows,
            apply_seconds_max=max(float(w.apply_seconds) for w in workers),
            newest_delta_created_at=created, newest_delta_age_s=age, workers=workers)

    async def summaries(self) -> dict[str, VersionSummary]:
        """Each served version's :class:`VersionSummary` (GET /state, GET
        /embeddings/deltas)."""
        pids = await self.live_pids()
        versions = self._versions()
        return await asyncio.to_thread(
            lambda: {v: self.summary(v, pids) for v in versions})

    def collect(self) -> Iterator[Metric]:
        """The delta gauges of every served version (module docstring)."""
        try:
            versions = self._versions()
        except Exception as e:  # noqa: BLE001 - never fail a scrape
            _log.warning("embedding delta metrics: served versions unknown: %s", e)
            versions = []
        pids = self._pids_for_scrape() if versions else frozenset()
        gauges = []
        for version in versions:
            try:
                gauges.append(self.summary(version, pids).gauges())
            except (OSError, ValueError, ServeError) as e:
                _log.warning("embedding delta metrics of %s skipped: %s", version, e)
        yield from embedding_delta_families(gauges)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
