"""The sidecar's side of embedding deltas: accept one, wait for the workers, report them.

A posted delta (:mod:`serve.sidecar.http.routes_deltas`) is checked completely before the store
changes, in this order, and any failure leaves the store as it was:

1. the body size (413 over :attr:`DeltaService.max_bytes`, ``--max-delta-bytes``), while
   it streams into a file in the store's folder (hashed on the way; the body is never
   held in memory);
2. the file itself, read back in chunks with only its ids loaded
   (:func:`serve.store.deltas.format.scan_delta_file`: magic, header, sizes, checksum; 400
   naming the field);
3. its base version is one the pod serves now, the stable version or a rollout's
   candidate (409 naming both);
4. it fits that version's tables (:func:`serve.store.deltas.format.check_layout` against the build
   report's profile and dtype; 400 naming the field);
5. its sequence is the version's next one (:meth:`serve.store.deltas.format.DeltaStore.commit`;
   409 for a gap or other bytes under a stored sequence). The same bytes again are
   stored once (outcome ``unchanged``); other bytes for a stored sequence whose file is
   damaged replace it (``repaired``: the workers, which retry a damaged delta every poll,
   then apply it);
6. it builds on what this pod holds (in the same step, under the store's lock): its
   ``parent_digest`` is the digest of the version's last stored delta, or for sequence 1
   the version's identity (:func:`serve.store.deltas.format.version_digest` of its build
   report); otherwise 409 ``DeltaConflict`` with ``reason`` ``parent_mismatch`` and both
   digests (``expected_parent_digest``: what this pod holds; ``parent_digest``: the
   delta's). A delta 1 written before the field existed is taken; a later one without it
   is 400. Then the file is fsynced, renamed into place and its folder fsynced.

Every refusal of a POST is counted by reason in ``dlrm_delta_posts_refused_total``
(:data:`serve.metrics.DELTA_REFUSAL_REASONS`); a volume file not taken is counted in
``dlrm_delta_files_skipped_total`` (``parent_mismatch`` among its reasons).

**One chain per fleet.** In Kubernetes every pod's store is its own (an ``emptyDir``), so
a delta POSTed to one pod (the Service picks it) would live in that pod only, and the
next one built on it would be refused by every other pod. There the sidecar runs with
``--deltas-post refuse`` (:class:`serve.sidecar.config.SidecarConfig` ``deltas_post``):
the POST answers 409 naming where to publish instead, the model volume
(``<repository>/deltas/<version>/<model>-<version>-NNNNNNNN.delta``), which every pod's
:meth:`DeltaService.sync` follows. ``store`` (the default) keeps the POST for one pod
(``make up``, tests, a hotfix by port-forward).

A damaged stored delta (truncated on a crash, changed on the disk) is named by GET
/embeddings/deltas (:meth:`DeltaService.damaged`) rather than blocking its version
silently. :meth:`DeltaService.clean` deletes the folders of versions no longer served
once no live worker maps them.

Then the TorchServe workers apply it: each worker follows ``<delta_dir>/<version>/``,
applies new deltas in order between two batches and writes
``<delta_dir>/<version>/workers/<pid>.json`` (:class:`serve.store.deltas.format.WorkerStatus`) after
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

**Managed id maps** (tables with ``mapping="managed"``, :mod:`serve.runtime.idmap`).
Deltas of such tables admit ids (assign them rows) and evict ids. The service counts them
once per pod, when a delta is stored (``dlrm_embedding_ids_admitted_total{feature}``,
``dlrm_embedding_ids_evicted_total{feature}``), and describes each served version's maps
(:meth:`DeltaService.id_maps`, GET /state ``embeddings.<version>.id_maps``, the gauge
``dlrm_embedding_id_map_occupancy_ratio{version,feature}``) without asking a worker:

    ids = admitted at build (the build report's ``id_mapping.tables.<table>.admitted``)
          + assigned - evicted over the deltas 1..applied_sequence

Why here and not in the workers: the sum is exact (a worker's ``IdMap.apply`` refuses an
eviction of an absent id and an assignment of a present one, so every applied change
moves the count by one), every worker of a version holds the same map after the same
deltas, so a per-worker count would only repeat it; and the sidecar already has both
inputs, the report and the stored deltas (their per-table counts, read once per file and
kept), so a scrape costs no worker time, and the count is per pod, never per worker.
The deltas counted are those every live worker applied (``applied_sequence``; the stored
ones while no worker reports). A report without ``id_mapping`` (a version built before
it, or a test artifact) gives ``ids`` and ``occupancy`` null, never a made-up number.
``fallback_lookups`` is the pod's ``dlrm_embedding_ids_fallback_total`` of the feature
and version, summed over its workers' metric files (null without the workers' metrics
directory).
A version without a managed table has ``id_maps: []``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from serve.errors import (
    DeltaConflict,
    InsufficientMemory,
    InvalidDelta,
    PayloadTooLarge,
    ServeError,
)
from serve.metrics import (
    EmbeddingDeltaGauges,
    IdMapGauge,
    delta_files_skipped_family,
    delta_posts_refused_family,
    embedding_delta_families,
    embedding_id_families,
)
from serve.schema import ModelSchema, schema_from_report
from serve.store.deltas import format as delta_format
from serve.store.deltas.format import (
    Delta,
    DeltaStore,
    Incoming,
    WorkerStatus,
    check_layout,
    decode_delta,
    layout_for_report,
    scan_delta_file,
    version_digest,
)

__all__ = [
    "POLL_INTERVAL_S",
    "WAIT_DEFAULT_S",
    "WAIT_MAX_S",
    "Accepted",
    "DeltaService",
    "IdMapStatus",
    "LivePids",
    "VersionSummary",
    "WaitResult",
    "model_versions",
    "refusal_reason",
]

_log = logging.getLogger(__name__)

# A TorchServe serving version: <version>_b<batch>d<delay>w<workers>[_c<candidate>].
_SERVING = re.compile(r"^(?P<v>.+?)_b\d+d\d+w\d+(?:_c(?P<c>.+))?$")

# A delta file on the model volume: anything ending in its 8-digit sequence + ".delta".
_VOLUME_FILE = re.compile(r"(\d{8})\.delta\Z")

#: Bytes gathered from the request stream before one write to the incoming file.
_WRITE_CHUNK = 1 << 20

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
    """A delta that passed every check and is stored: ``outcome`` ``stored`` (new),
    ``unchanged`` (the same bytes were stored already) or ``repaired`` (it replaced a
    damaged stored file)."""

    version: str
    sequence: int
    rows: int
    bytes: int
    created_at: float
    outcome: str = "stored"


@dataclass(frozen=True)
class WaitResult:
    """How the wait for the workers ended: ``applied`` when every live worker serving the
    version (at least one) reports the sequence; ``workers`` their statuses at the end."""

    applied: bool
    workers: tuple[WorkerStatus, ...]
    waited_s: float


@dataclass(frozen=True)
class IdMapStatus:
    """One managed feature's id map in one served version (module docstring).

    ``capacity``: ids the table can hold (rows - fallback rows); ``ids``: ids
    holding a row now (build + ``admitted`` - ``evicted``; None when the build report
    does not say how many the build admitted); ``occupancy`` = ids / capacity (0..1);
    ``admitted`` / ``evicted``: ids the applied deltas (1..``sequence``) assigned a row /
    evicted; ``fallback_lookups``: the pod's lookups of the feature that read the
    fallback row (None when unknown).
    """

    feature: str
    table: str
    capacity: int
    ids: int | None
    occupancy: float | None
    admitted: int
    evicted: int
    sequence: int
    fallback_lookups: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"feature": self.feature, "table": self.table, "capacity": self.capacity,
                "ids": self.ids, "occupancy": self.occupancy, "admitted": self.admitted,
                "evicted": self.evicted, "sequence": self.sequence,
                "fallback_lookups": self.fallback_lookups}


#: Per delta file: table index -> (ids assigned, ids evicted), tables with changes only.
_IdCounts = dict[int, tuple[int, int]]


def _id_counts(delta: Delta) -> _IdCounts:
    return {t.table: (int(t.assign_ids.shape[0]), int(t.evict_ids.shape[0]))
            for t in delta.tables if t.id_changes}


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
        max_bytes: the largest delta (default
            :data:`serve.store.deltas.format.MAX_DELTA_BYTES`; the sidecar passes
            ``--max-delta-bytes``).
        max_store_bytes: the most bytes of deltas the store may hold, all versions and
            the body being received together (``--max-delta-store-bytes``); None: no
            bound. In Kubernetes the store is memory-backed and its pages are charged to
            the sidecar's container until their version stops being served, so this
            bound, not one delta's size, is what keeps the sidecar inside its memory.
        fallback_counts: the pod's fallback-row lookups, ``{version: {feature: n}}``
            (the workers' ``dlrm_embedding_ids_fallback_total``), for GET /state's
            ``id_maps``; None: unknown (``fallback_lookups`` null).
    """

    def __init__(self, store: DeltaStore, *, versions: Callable[[], list[str]],
                 report_of: Callable[[str], dict[str, Any]],
                 live_pids: LivePids | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 pid_ttl_s: float = 1.0, max_bytes: int | None = None,
                 max_store_bytes: int | None = None,
                 fallback_counts: Callable[[], dict[str, dict[str, int]]] | None = None
                 ) -> None:
        self.store = store
        self.fallback_counts = fallback_counts
        self._admitted: dict[str, int] = {}
        self._evicted: dict[str, int] = {}
        # (version, sequence) -> ((size, mtime_ns) of its file, its id counts): read once.
        self._id_counts: dict[tuple[str, int], tuple[tuple[int, int], _IdCounts]] = {}
        # version -> its schema and the ids its build admitted per table (None: unknown).
        self._builds: dict[str, tuple[ModelSchema, dict[str, int | None]]] = {}
        self.max_store_bytes = max_store_bytes
        #: The largest delta accepted (bytes): POST bodies and volume files. The one limit
        #: of a delta; the request guard reads it here too.
        self.max_bytes = delta_format.MAX_DELTA_BYTES if max_bytes is None else max_bytes
        self._skipped: dict[str, int] = {}
        self._refused: dict[str, int] = {}
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
        self._sync_failed: set[tuple[Path, int | None, str]] = set()
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
        """Raise :class:`~serve.errors.PayloadTooLarge` for a body over :attr:`max_bytes`."""
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"body: {size} bytes is over the {self.max_bytes}-byte limit of one delta "
                f"(--max-delta-bytes); split the rows into several deltas (consecutive "
                f"sequence numbers)")

    def check_room(self, size: int, held: int | None = None) -> int:
        """Raise :class:`~serve.errors.InsufficientMemory` (507) when ``size`` more bytes
        would take the store's deltas past :attr:`max_store_bytes`; return the bytes held
        now (``held``, when the caller has read them already)."""
        held = self.store.delta_bytes() if held is None else held
        if self.max_store_bytes is not None and held + size > self.max_store_bytes:
            raise InsufficientMemory(
                f"body: {size} bytes would take the pod's delta store from {held} bytes past "
                f"its {self.max_store_bytes}-byte bound (--max-delta-store-bytes: the "
                f"deltas stay in memory until their version stops being served); fold the "
                f"deltas into a new version (make model / make import) and declare it, "
                f"or raise the bound together with the sidecar's memory limit")
        return held

    def check_served(self, delta: Delta) -> None:
        """Steps 3-4 of the module docstring: a served version, and its tables.

        Raises:
            DeltaConflict: its base version is not served here (409).
            InvalidDelta: it does not fit the version's tables (400).
        """
        served = self._versions()
        if delta.base_version not in served:
            raise DeltaConflict(
                "header.base_version",
                f"{delta.base_version!r} is not served by this pod, which serves "
                f"{served or 'no version (no desired state)'}; build the delta against "
                f"the stable version or the rollout's candidate (GET /state)",
                reason="base_version")
        check_layout(delta, layout_for_report(self._report_of(delta.base_version)))

    def base_digest(self, version: str) -> str:
        """The identity of ``version`` that its delta 1 names as ``parent_digest``
        (:func:`serve.store.deltas.format.version_digest` of its build report)."""
        return version_digest(self._report_of(version))

    def head_digest(self, version: str) -> str | None:
        """What the next delta of ``version`` must name as its parent (blocking reads):
        the digest of its last stored delta, else :meth:`base_digest`; None when the
        report cannot be read."""
        try:
            last = self.store.last_sequence(version)
            return self.store.digest(version, last) if last else self.base_digest(version)
        except (OSError, ValueError, ServeError) as e:
            _log.warning("the head digest of %s's deltas cannot be read: %s", version, e)
            return None

    def validate(self, blob: bytes) -> Delta:
        """Every check of a delta held in memory (module docstring, steps 1-4); changes
        nothing. The POST and the volume sync stream to a file instead (:meth:`receive`).

        Raises:
            PayloadTooLarge, InvalidDelta, DeltaConflict: see :meth:`check_served`.
        """
        self.check_size(len(blob))
        delta = decode_delta(blob, self.max_bytes)
        self.check_served(delta)
        return delta

    async def receive(self, chunks: AsyncIterator[bytes]) -> Accepted:
        """Stream a delta body into the store: each chunk is written to a file in the
        store's folder and hashed on the way (never the whole body in memory), then the
        file is read back in chunks and validated (steps 2-4, only the ids in memory) and moved into place (step 5).

        Raises:
            the errors of :meth:`validate` and :meth:`DeltaStore.commit`; nothing stays
            stored on any of them (each counted in :attr:`refused`).
        """
        try:
            return await self._receive(chunks)
        except ServeError as e:
            self.count_refusal(refusal_reason(e))
            raise

    async def _receive(self, chunks: AsyncIterator[bytes]) -> Accepted:
        held = await asyncio.to_thread(self.check_room, 0)
        incoming = await asyncio.to_thread(self.store.incoming, self.max_bytes)
        try:
            pending, size = bytearray(), 0
            async for chunk in chunks:
                size += len(chunk)
                self.check_size(size)
                self.check_room(size, held)
                pending += chunk
                if len(pending) >= _WRITE_CHUNK:
                    await asyncio.to_thread(incoming.write, pending)
                    pending = bytearray()
            if pending:
                await asyncio.to_thread(incoming.write, pending)
        except BaseException:
            await asyncio.to_thread(incoming.discard)
            raise
        return await asyncio.to_thread(self._accept, incoming)

    def receive_file(self, path: Path) -> Accepted:
        """:meth:`receive` for a file (the model volume): copied in 1 MiB chunks."""
        self.check_room(path.stat().st_size)
        incoming = self.store.incoming(self.max_bytes)
        try:
            with open(path, "rb") as f:
                while chunk := f.read(_WRITE_CHUNK):
                    incoming.write(chunk)
        except BaseException:
            incoming.discard()
            raise
        return self._accept(incoming)

    def _accept(self, incoming: Incoming) -> Accepted:
        try:
            incoming.finish()
            delta = scan_delta_file(incoming.path, self.max_bytes)
            self.check_served(delta)
            base = self.base_digest(delta.base_version)
        except BaseException:
            incoming.discard()
            raise
        stored = self.store.commit(incoming, delta, self.max_bytes, base_digest=base)
        if stored.outcome != "unchanged":
            self._remember_ids(delta, stored.path, count=stored.outcome == "stored")
        _log.info("embedding delta %s #%d %s (%d rows, %d bytes)", delta.base_version,
                  delta.sequence, stored.outcome, delta.rows, incoming.size)
        return Accepted(delta.base_version, delta.sequence, delta.rows, incoming.size,
                        delta.created_at, stored.outcome)

    def add(self, blob: bytes) -> Accepted:
        """Validate ``blob`` and store it as its version's next delta (blocking I/O: run
        it in a thread). The same as :meth:`receive`, for bytes in memory.

        Raises:
            the errors of :meth:`validate`; DeltaConflict for a repeated or skipped
            sequence or another parent (the store is unchanged on every error; each
            counted in :attr:`refused`).
        """
        try:
            return self._add(blob)
        except ServeError as e:
            self.count_refusal(refusal_reason(e))
            raise

    def _add(self, blob: bytes) -> Accepted:
        self.validate(blob)
        self.check_room(len(blob))
        incoming = self.store.incoming(self.max_bytes)
        try:
            incoming.write(blob)
        except BaseException:
            incoming.discard()
            raise
        return self._accept(incoming)

    # ------------------------------------------------------------------ model volume

    def sync(self, roots: Iterable[Path]) -> list[Accepted]:
        """Pick up deltas published on the model volume: for each served version, the
        files ``<root>/deltas/<version>/*<seq:08d>.delta`` (what ``make delta`` writes,
        e.g. ``dlrm-small-int8-s0-00000001.delta``) whose sequence is above the store's,
        in sequence order, through the same checks as a POST (:meth:`receive_file`).

        This is how every pod of a Deployment gets the same deltas, including pods that
        start later (a new pod's store is empty: it replays the volume's deltas of its
        version before its workers' first batch settles). Each file's size is read
        (``stat``) before any byte: one over :attr:`max_bytes` is skipped, never read.
        A file skipped or failing a check is logged once, counted once in
        ``dlrm_delta_files_skipped_total{reason}``, and stops that version's sync there
        (later ones need it). A pass always completes (readiness waits for one pass,
        never for a bad file).
        """
        out: list[Accepted] = []
        try:
            for version in self._versions():
                out += self._sync_version(version, roots)
        finally:
            self._synced = True
        return out

    def _volume_files(self, version: str, roots: Iterable[Path], last: int) -> dict[int, Path]:
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
        return found

    def _sync_version(self, version: str, roots: Iterable[Path]) -> list[Accepted]:
        out: list[Accepted] = []
        last = self.store.last_sequence(version)
        found = self._volume_files(version, roots, last)
        for seq in sorted(found):
            if seq != last + 1:
                break  # a gap on the volume: wait for the missing one
            path = found[seq]
            try:
                size = path.stat().st_size
                if size > self.max_bytes:
                    self._skip(path, size, "too_large",
                               f"{size} bytes is over the {self.max_bytes}-byte limit of "
                               f"one delta (--max-delta-bytes); not read. Split it into "
                               f"smaller deltas or raise the limit (and the sidecar's memory)")
                    break
                accepted = self.receive_file(path)
            except (ServeError, OSError) as e:
                reason = ("unreadable" if isinstance(e, OSError) else
                          "store_full" if isinstance(e, InsufficientMemory) else
                          "parent_mismatch" if isinstance(e, DeltaConflict)
                          and e.reason == "parent_mismatch" else "invalid")
                self._skip(path, None, reason, str(getattr(e, "message", e)))
                break
            _log.info("embedding delta %s #%d picked up from %s", version, seq, path)
            out.append(accepted)
            last = seq
        return out

    def _skip(self, path: Path, size: int | None, reason: str, why: str) -> None:
        """Log and count a volume file not taken, once per file (and size)."""
        key = (path, size, reason)
        with self._state_lock:
            if key in self._sync_failed:
                return
            self._sync_failed.add(key)
            self._skipped[reason] = self._skipped.get(reason, 0) + 1
        _log.error("embedding delta %s from the model volume not taken (%s): %s", path,
                   reason, why)

    @property
    def skipped(self) -> dict[str, int]:
        """Volume files not taken so far, by reason (``too_large``, ``invalid``,
        ``unreadable``, ``store_full``, ``parent_mismatch``: retried on every pass)."""
        with self._state_lock:
            return dict(self._skipped)

    def count_refusal(self, reason: str) -> None:
        """Count one refused POST (``reason``: :func:`refusal_reason`)."""
        with self._state_lock:
            self._refused[reason] = self._refused.get(reason, 0) + 1

    @property
    def refused(self) -> dict[str, int]:
        """POSTed deltas refused so far, by reason (:func:`refusal_reason`)."""
        with self._state_lock:
            return dict(self._refused)

    # ------------------------------------------------------------------ id maps

    def _remember_ids(self, delta: Delta, path: Path, *, count: bool) -> None:
        """Keep a stored delta's id counts (no re-read later) and, when ``count`` (a new
        sequence, not a repaired file), add them to the admitted/evicted counters."""
        counts = _id_counts(delta)
        try:
            st = path.stat()
        except OSError:
            return
        with self._state_lock:
            self._id_counts[(delta.base_version, delta.sequence)] = (
                (st.st_size, st.st_mtime_ns), counts)
            if not count:
                return
            for t in delta.tables:
                if t.assign_ids.shape[0]:
                    self._admitted[t.feature] = (self._admitted.get(t.feature, 0)
                                                 + int(t.assign_ids.shape[0]))
                if t.evict_ids.shape[0]:
                    self._evicted[t.feature] = (self._evicted.get(t.feature, 0)
                                                + int(t.evict_ids.shape[0]))

    @property
    def admitted(self) -> dict[str, int]:
        """Ids admitted by the deltas stored so far, per feature (the delta's name for
        the table)."""
        with self._state_lock:
            return dict(self._admitted)

    @property
    def evicted(self) -> dict[str, int]:
        """Ids evicted by the deltas stored so far, per feature."""
        with self._state_lock:
            return dict(self._evicted)

    def _stored_id_counts(self, version: str, sequence: int) -> _IdCounts:
        """A stored delta's id counts: kept from its commit, else read once from its file
        (ids only, :func:`serve.store.deltas.format.scan_delta_file`) and kept while the
        file is unchanged. Raises OSError / ServeError for a file that cannot be read."""
        path = self.store.path(version, sequence)
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        with self._state_lock:
            got = self._id_counts.get((version, sequence))
        if got is not None and got[0] == key:
            return got[1]
        counts = _id_counts(scan_delta_file(path, self.max_bytes))
        with self._state_lock:
            self._id_counts[(version, sequence)] = (key, counts)
        return counts

    def _build(self, version: str) -> tuple[ModelSchema, dict[str, int | None]]:
        """``version``'s schema and its build's admitted ids per managed table (from its
        build report, read once: a version's report never changes)."""
        with self._state_lock:
            got = self._builds.get(version)
        if got is not None:
            return got
        report = self._report_of(version)
        schema = schema_from_report(report)
        mapping = report.get("id_mapping")
        tables = mapping.get("tables") if isinstance(mapping, dict) else None
        admitted: dict[str, int | None] = {}
        for t in schema.tables:
            if t.mapping != "managed":
                continue
            entry = tables.get(t.name) if isinstance(tables, dict) else None
            n = entry.get("admitted") if isinstance(entry, dict) else None
            admitted[t.name] = int(n) if isinstance(n, int) and not isinstance(n, bool) \
                and n >= 0 else None
        with self._state_lock:
            self._builds[version] = (schema, admitted)
        return schema, admitted

    def id_maps(self, version: str, through: int,
                fallback: dict[str, int] | None = None) -> tuple[IdMapStatus, ...]:
        """Each managed feature of ``version`` after its build and deltas 1..``through``
        (module docstring); ``fallback``: the pod's fallback lookups of ``version`` per
        feature. Empty
        for a version without managed tables. Blocking file reads (cached).

        Raises:
            OSError, ServeError: the report or a stored delta cannot be read.
        """
        schema, build = self._build(version)
        if not build:
            return ()
        assigned = dict.fromkeys(build, 0)
        evicted = dict.fromkeys(build, 0)
        for seq in range(1, through + 1):
            for t, (k, e) in self._stored_id_counts(version, seq).items():
                name = schema.tables[t].name if 0 <= t < len(schema.tables) else None
                if name in assigned:
                    assigned[name] += k
                    evicted[name] += e
        out = []
        for f, t in zip(schema.features, schema.feature_tables, strict=True):
            spec = schema.tables[t]
            if spec.name not in build:
                continue
            at_build = build[spec.name]
            ids = None if at_build is None else at_build + assigned[spec.name] - evicted[spec.name]
            cap = spec.rows - spec.fallback_rows
            out.append(IdMapStatus(
                feature=f.name, table=spec.name, capacity=cap, ids=ids,
                occupancy=None if ids is None or cap <= 0 else min(1.0, max(0.0, ids / cap)),
                admitted=assigned[spec.name], evicted=evicted[spec.name], sequence=through,
                fallback_lookups=None if fallback is None else int(fallback.get(f.name, 0))))
        return tuple(out)

    # ------------------------------------------------------------------ clean-up

    def clean(self, keep: Iterable[str], live_pids: Iterable[int]) -> list[str]:
        """Delete the folder (deltas, statuses, ``tables.bin``) of every version in the
        store that is not in ``keep`` (served or still registered) and that no live
        worker reports in (a worker of it still maps its table); drop bodies left
        half-received by a dead process. Returns the versions removed."""
        keep, pids = set(keep), set(live_pids)
        removed = []
        for version in self.store.versions():
            if version in keep or self.store.worker_statuses(version, sorted(pids)):
                continue
            held = self.store.remove_version(version)
            removed.append(version)
            _log.info("delta folder of version %s removed (%d bytes): it is no longer "
                      "served and no live worker maps it", version, held)
        self.store.drop_stale_incoming()
        return removed

    def held_bytes(self, live_versions: Iterable[str]) -> int:
        """Bytes in the delta folder, less the shared tables of ``live_versions`` (counted
        in their workers' RSS already)."""
        return self.store.held_bytes(sorted(set(live_versions)))

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
            maps = self.id_maps(version, min(through, last), fallback)
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
        pids = await self.live_pids()
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
        got = await asyncio.to_thread(
            lambda: {v: self.store.damaged(v, self.max_bytes) for v in versions})
        return {v: d for v, d in got.items() if d}

    def collect(self) -> Iterator[Metric]:
        """The delta gauges of every served version (module docstring)."""
        try:
            versions = self._versions()
        except Exception as e:  # noqa: BLE001 - never fail a scrape
            _log.warning("embedding delta metrics: served versions unknown: %s", e)
            versions = []
        pids = self._pids_for_scrape() if versions else frozenset()
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
        yield from embedding_id_families(self.admitted, self.evicted, occupancy)
        yield delta_files_skipped_family(self.skipped)
        yield delta_posts_refused_family(self.refused)


def refusal_reason(error: ServeError) -> str:
    """The bounded reason label of a refused delta (:data:`serve.metrics.DELTA_REFUSAL_REASONS`):
    a :class:`~serve.errors.DeltaConflict`'s own ``reason`` (``base_version``,
    ``sequence``, ``parent_mismatch``, ``volume_only``), ``invalid`` (400), ``too_large``
    (413), ``store_full`` (507), else ``other``."""
    if isinstance(error, DeltaConflict):
        return error.reason
    if isinstance(error, InvalidDelta):
        return "invalid"
    if isinstance(error, PayloadTooLarge):
        return "too_large"
    if isinstance(error, InsufficientMemory):
        return "store_full"
    return "other"


def model_versions(serving_version: str) -> list[str]:
    """The repository versions a TorchServe serving version loads (its model version and
    a rollout's candidate): ``small-s0_b2d2w2_csmall-s7`` -> ``[small-s0, small-s7]``; a
    foreign name is taken as a version itself."""
    m = _SERVING.fullmatch(serving_version)
    if m is None:
        return [serving_version]
    return [m.group("v")] + ([m.group("c")] if m.group("c") else [])


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
