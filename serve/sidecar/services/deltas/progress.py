"""What the TorchServe workers have applied: :class:`WorkerProgress`.

Each worker follows ``<delta_dir>/<version>/``, applies new deltas in order between two
batches and writes ``<delta_dir>/<version>/workers/<pid>.json``
(:class:`serve.store.deltas.status.WorkerStatus`) after each apply and once at start
with sequence 0. The workers serving a version are the status files of that version
whose pid TorchServe lists as a worker now (a rollout's worker serves both versions and
writes one file for each); files of dead workers are ignored. A delta is *applied* once
at least one such worker reports, and every one of them reports a sequence at least the
delta's: with no worker reporting, nothing has applied it.

Live pids come from TorchServe's management API
(:func:`serve.sidecar.adapters.torchserve.observe`), cached for
:attr:`WorkerProgress.pid_ttl_s` so that polling and scrapes do not hammer it; tests
inject their own source. When TorchServe does not answer, the last pids known are used
(none before the first answer).

This is the only part of the delta service bound to the app's event loop: its pid
cache is refreshed there, and a Prometheus scrape (a thread) asks the loop for it
(:meth:`WorkerProgress.pids_for_scrape`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from serve.errors import ServeError
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.status import WorkerStatus

__all__ = [
    "POLL_INTERVAL_S",
    "WAIT_DEFAULT_S",
    "WAIT_MAX_S",
    "LivePids",
    "WaitResult",
    "WorkerProgress",
]

_log = logging.getLogger(__name__)

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
class WaitResult:
    """How the wait for the workers ended: ``applied`` when every live worker serving the
    version (at least one) reports the sequence; ``workers`` their statuses at the end."""

    applied: bool
    workers: tuple[WorkerStatus, ...]
    waited_s: float


class WorkerProgress:
    """The live workers and what they applied (module docstring).

    Lock discipline: the pid cache changes only on the app's event loop, under an
    ``asyncio.Lock``; other threads (a scrape) read one immutable snapshot, ``(pids,
    read at)``, replaced whole. The readiness latch is set on the loop only.

    Args:
        store: the pod's delta store (the workers' status files).
        versions: the versions the pod serves now (``Sidecar.served_versions``).
        live_pids: the live TorchServe worker pids (default none until
            :meth:`set_live_pids` is called: the app connects it to TorchServe).
        clock: monotonic seconds, for the wait and the pid cache.
        sleep: awaited between two polls (tests pass a fake clock's).
        pid_ttl_s: how long a read of the live pids is reused.
    """

    def __init__(self, store: DeltaStore, *, versions: Callable[[], list[str]],
                 live_pids: LivePids | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 pid_ttl_s: float = 1.0) -> None:
        self.store = store
        self.clock = clock
        self.pid_ttl_s = pid_ttl_s
        self._versions = versions
        self._source = live_pids
        self._sleep = sleep
        self._known: tuple[frozenset[int], float] | None = None   # (pids, read at)
        self._pids_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._caught_up = False   # latched: the pod once had every stored delta applied

    # ------------------------------------------------------------------ live workers

    def set_live_pids(self, source: LivePids) -> None:
        """Read the live worker pids from ``source`` from now on (cache dropped)."""
        self._source = source
        self._known = None

    async def live_pids(self, *, max_age_s: float | None = None) -> frozenset[int]:
        """The live TorchServe worker pids, read at most ``max_age_s`` (default
        :attr:`pid_ttl_s`) ago; the last ones known when TorchServe does not answer."""
        self._loop = asyncio.get_running_loop()
        if self._pids_lock is None:
            self._pids_lock = asyncio.Lock()
        age = self.pid_ttl_s if max_age_s is None else max_age_s
        async with self._pids_lock:
            known = self._known
            if known is not None and self.clock() - known[1] < age:
                return known[0]
            source = self._source
            if source is None:
                return frozenset()
            try:
                pids = frozenset(int(p) for p in await source())
            except ServeError as e:
                last = known[0] if known is not None else frozenset()
                _log.warning("live worker pids unavailable, using the last known (%s): %s",
                             sorted(last), e.message)
                return last
            self._known = (pids, self.clock())
            return pids

    def pids_for_scrape(self, timeout_s: float = 2.0) -> frozenset[int]:
        """Live pids from a synchronous caller (a scrape runs ``generate_latest`` in a
        thread): refreshed on the app's loop when called off it, else the cached ones."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _on_loop(loop):
            try:
                fut = asyncio.run_coroutine_threadsafe(self.live_pids(), loop)
                return fut.result(timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - a scrape must not fail over this
                _log.warning("live worker pids not refreshed for a scrape: %s", e)
        known = self._known
        return known[0] if known is not None else frozenset()

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

    # ------------------------------------------------------------------ readiness

    async def not_caught_up(self, volume_read: bool = True) -> str | None:
        """Why a starting pod is not ready yet as far as deltas go, or None.

        Until the pod first catches up: the model volume must have been read once
        (``volume_read``: :attr:`VolumeSync.synced
        <serve.sidecar.services.deltas.volume.VolumeSync.synced>`, or True when the
        sidecar does not follow a volume), and every live worker of each served version
        must have applied the store's last delta. Latched after that: a delta posted
        later, which the workers apply within their poll interval, never takes a serving
        pod out of the Service.
        """
        if self._caught_up:
            return None
        if not volume_read:
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


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
