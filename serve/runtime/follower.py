"""A worker follows its version's embedding deltas: in order, once, between two batches.

The sidecar validates a posted delta and adds it to the pod's :class:`serve.store.deltas.files.DeltaStore`
(``<delta_dir>/<version>/<seq>.delta``). Every worker runs one :class:`DeltaFollower` per
version it serves (stable, and a rollout's candidate). Its steps, each a method:

1. :meth:`pending`: the store's sequence numbers above the one applied here;
2. :meth:`load`: read and check the next one (checksum, base version, sequence, the
   runtime's tables) *outside* the batch lock, so batches go on meanwhile;
3. :meth:`apply`: under the worker's batch lock (a batch holds it for its whole
   forward, so a batch sees all of a delta or none of it) change the managed tables' id
   maps (``Runtime.update_ids``: admitted ids get their rows, evicted ids the fallback)
   and overwrite the rows: ``Runtime.update_rows`` writes the host rows and the
   device-cached copies. With the
   pod-wide shared table (:mod:`serve.runtime.shared`, the id maps in the same file) it
   also takes that table's write lock (no worker is mid-batch), and only the first worker
   to get there writes maps and rows: the
   others find the table's sequence already there (one copy, so each worker's view gets
   the delta exactly once either way);
4. :meth:`write_status`: ``workers/<pid>.json`` (sequence, rows, apply seconds), which
   the sidecar reads for ``GET /state``, ``/metrics`` and to answer the POST.

:meth:`catch_up` runs 1-4 until nothing is pending: at worker start (before the first
batch: a new or restarted worker serves every delta of its version), then from a
background thread every ``poll_s``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from serve.errors import DeltaConflict, InvalidDelta, ServeError
from serve.runtime.idmap import IdMap
from serve.runtime.shared import SharedTables
from serve.schema import ModelSchema
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import Delta
from serve.store.deltas.layout import TableLayout, check_layout, layout_for_schema
from serve.store.deltas.status import WorkerStatus

__all__ = ["DeltaFollower", "DeltaTarget", "runtime_layout"]

log = logging.getLogger(__name__)


def _int64(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


class DeltaTarget(Protocol):
    """What a follower writes deltas into: :class:`serve.runtime.engine.Runtime` is one.

    A protocol rather than the class itself, so this module needs only what it uses: the
    model's schema (the layout a delta must fit), the pod-wide shared table when the rows
    are served from one (its write lock and applied sequence), and the row writer.
    """

    @property
    def schema(self) -> ModelSchema: ...

    @property
    def shared(self) -> SharedTables | None: ...

    def check_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...

    def update_rows(self, table: int, ids: torch.Tensor, rows: torch.Tensor) -> None: ...

    def changed_id_map(self, table: int, assign_ids: torch.Tensor, assign_rows: torch.Tensor,
                       evict_ids: torch.Tensor) -> IdMap: ...

    def set_id_map(self, table: int, id_map: IdMap) -> None: ...


def runtime_layout(runtime: DeltaTarget) -> TableLayout:
    """What a delta must fit, from a :class:`serve.runtime.engine.Runtime`'s schema."""
    return layout_for_schema(runtime.schema)


class DeltaFollower:
    """Applies one version's deltas to one runtime.

    Args:
        store: the pod's delta store.
        version: the version this runtime serves.
        runtime: a :class:`serve.runtime.engine.Runtime` (``update_rows``, ``shared``).
        batch_lock: held by the worker for each batch; taken here for each apply.
        pid: written in the status (default: this process).
        clock: wall seconds (status timestamps); perf: seconds for durations.
    """

    def __init__(self, store: DeltaStore, version: str, runtime: DeltaTarget,
                 batch_lock: threading.Lock, *, pid: int | None = None,
                 clock: Callable[[], float] = time.time,
                 perf: Callable[[], float] = time.perf_counter) -> None:
        self.store, self.version, self.runtime = store, version, runtime
        self.batch_lock = batch_lock
        self.pid = os.getpid() if pid is None else pid
        self.clock, self.perf = clock, perf
        self.layout = runtime_layout(runtime)
        self.applied = 0
        self.rows = 0
        self.apply_seconds = 0.0
        self.applied_at = 0.0
        self.created_at = 0.0
        self._failed: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- steps ---------------------------------------------------------------------------
    def pending(self) -> list[int]:
        """Sequence numbers in the store not applied here yet, ascending."""
        return [s for s in self.store.sequences(self.version) if s > self.applied]

    def load(self, sequence: int) -> Delta:
        """Read and check delta ``sequence`` (no lock held).

        Raises:
            InvalidDelta: unreadable, bad checksum, does not fit the tables.
            DeltaConflict: another base version, or not the next sequence here.
        """
        delta = self.store.read(self.version, sequence)
        if delta.base_version != self.version:
            raise DeltaConflict("header.base_version",
                                f"{delta.base_version!r} is not this worker's version "
                                f"{self.version!r}")
        if delta.sequence != sequence or sequence != self.applied + 1:
            raise DeltaConflict("header.sequence",
                                f"{delta.sequence} (file {sequence}) is not the next after "
                                f"{self.applied}")
        check_layout(delta, self.layout)
        return delta

    def id_maps(self, delta: Delta) -> dict[int, IdMap]:
        """The managed tables' maps after ``delta``'s id changes (nothing changed yet), so
        a change the maps refuse stops the delta before any of it lands. Empty when the
        pod-wide shared file holds the delta already (another worker wrote it: its maps
        are this worker's maps). With the shared file this reads it under its read lock
        (no writer midway), and so under the batch lock too: the lock's descriptor is the
        process's, and a batch of this worker holds it meanwhile otherwise (releasing it
        here would release the batch's). Milliseconds: the maps' size, not the rows'.

        Raises:
            DeltaConflict: an evicted id not in the map, an assigned id or row taken.
        """
        shared = self.runtime.shared
        if shared is None:
            return self._changed_maps(delta)
        if not any(t.id_changes for t in delta.tables):
            return {}
        with self.batch_lock, shared.read():
            if shared.sequence() >= delta.sequence:
                return {}
            return self._changed_maps(delta)

    def _changed_maps(self, delta: Delta) -> dict[int, IdMap]:
        out: dict[int, IdMap] = {}
        for i, t in enumerate(delta.tables):
            if not t.id_changes:
                continue
            try:
                out[t.table] = self.runtime.changed_id_map(
                    t.table, _int64(t.assign_ids), _int64(t.assign_rows), _int64(t.evict_ids))
            except ServeError as e:
                raise DeltaConflict(f"tables[{i}].assigned",
                                    f"{e.message}: the delta does not fit this version's id "
                                    "map", reason="id_map") from e
        return out

    @staticmethod
    def _place(maps: dict[int, IdMap]) -> None:
        """Hash the changed maps (:attr:`IdMap.placement`, cached on each map) before
        batches are stopped: under the write lock, writing them is only copies.

        Raises:
            DeltaConflict: a map without a placement (not seen at the maps' load).
        """
        for table, id_map in maps.items():
            try:
                _ = id_map.placement
            except ServeError as e:
                raise DeltaConflict("tables", f"table {table}: {e.message}",
                                    reason="id_map") from e

    def apply(self, delta: Delta, id_maps: dict[int, IdMap] | None = None) -> float:
        """Write ``delta``'s id changes and rows between two batches; return the seconds
        the write took (not the wait for the running batch). ``id_maps``: from
        :meth:`id_maps` (computed here when None)."""
        maps = self.id_maps(delta) if id_maps is None else id_maps
        self._place(maps)
        return self._write(delta, maps)

    def _checked_rows(self, delta: Delta) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Every table's (table, ids, rows as stored), each checked by the runtime before
        any is written: a delta is applied whole or not at all.

        Raises:
            InvalidDelta: a table whose ids or rows the runtime refuses (named).
        """
        prepared = []
        for i, t in enumerate(delta.tables):
            ids = _int64(t.ids)
            try:
                rows = self.runtime.check_rows(
                    t.table, ids, torch.from_numpy(np.array(t.rows, dtype=np.uint8)))
            except ServeError as e:
                raise InvalidDelta(f"tables[{i}].rows", f"table {t.table} ({t.feature}): "
                                   f"{e.message}; nothing of the delta was applied") from e
            prepared.append((t.table, ids, rows))
        return prepared

    def _write(self, delta: Delta, maps: dict[int, IdMap],
               prepared: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None) -> float:
        """:meth:`apply` with ``maps`` already placed (:meth:`_place`). Every table is
        checked first (:meth:`_checked_rows`, unless ``prepared`` holds its result), then
        the maps and rows are written."""
        if prepared is None:
            prepared = self._checked_rows(delta)
        shared = self.runtime.shared
        with self.batch_lock, (shared.write() if shared is not None
                               else contextlib.nullcontext()):
            t0 = self.perf()
            if shared is None or shared.sequence() < delta.sequence:
                for table, id_map in maps.items():
                    self.runtime.set_id_map(table, id_map)
                for table, ids, rows in prepared:
                    self.runtime.update_rows(table, ids, rows)
                if shared is not None:
                    shared.set_sequence(delta.sequence)
            seconds = self.perf() - t0
        self.applied = delta.sequence
        self.rows += delta.rows
        self.apply_seconds = seconds
        self.applied_at = self.clock()
        self.created_at = delta.created_at
        return seconds

    def status(self) -> WorkerStatus:
        return WorkerStatus(pid=self.pid, version=self.version, sequence=self.applied,
                            rows=self.rows, apply_seconds=round(self.apply_seconds, 6),
                            applied_at=self.applied_at, created_at=self.created_at)

    def write_status(self) -> None:
        self.store.write_worker_status(self.status())

    def catch_up(self) -> int:
        """Apply every pending delta in order; return how many were applied. A delta that
        fails its checks stops the catch-up there (later ones need it) and is logged once;
        the worker keeps serving what it has."""
        done = 0
        for seq in self.pending():
            if seq != self.applied + 1:
                break  # a gap in the store: wait for the missing one
            try:
                delta = self.load(seq)
                maps = self.id_maps(delta)
                self._place(maps)
                prepared = self._checked_rows(delta)
            except (ServeError, OSError) as e:
                if self._failed != seq:
                    log.error("delta %s #%d not applied: %s", self.version, seq, e)
                    self._failed = seq
                break
            seconds = self._write(delta, maps, prepared)   # placed and checked above, once
            done += 1
            log.info("delta %s #%d applied: %d rows in %.2f ms", self.version, seq,
                     delta.rows, seconds * 1e3)
            self.write_status()
        return done

    # -- background ------------------------------------------------------------------------
    def start(self, poll_s: float) -> None:
        """Catch up every ``poll_s`` seconds from a daemon thread."""
        def loop() -> None:
            while not self._stop.wait(poll_s):
                try:
                    self.catch_up()
                except Exception:  # never let the follower die silently
                    log.exception("delta follower of %s failed; retrying", self.version)

        self._thread = threading.Thread(target=loop, name=f"deltas-{self.version}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
