"""A worker's side of the embedding deltas: the batch guard and the delta followers.

* :class:`BatchGuard`: the worker's batch lock and the read side of each runtime's
  shared table (:mod:`serve.runtime.shared`): a batch holds it while it runs, a delta
  lands only between two batches.
* :class:`DeltaFollowers`: one :class:`~serve.runtime.follower.DeltaFollower` per served
  version (stable, a rollout's candidate), applying the store's deltas
  (:mod:`serve.store.deltas`) before the first batch and later ones between batches.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

from serve.api.config import DeltaWiring
from serve.runtime.engine import Runtime
from serve.runtime.follower import DeltaFollower
from serve.store.deltas.files import DeltaStore

__all__ = ["BatchGuard", "DeltaFollowers"]

logger = logging.getLogger(__name__)


class BatchGuard:
    """A batch's hold on the tables of ``runtimes``: :attr:`lock` (a delta is applied
    between two batches under it) and the read side of each shared table (no delta lands
    in any worker of the pod while a batch runs)."""

    def __init__(self, runtimes: Sequence[Runtime]) -> None:
        self.lock = threading.Lock()
        self._runtimes = list(runtimes)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Held for one batch (or the warm-up)."""
        with self.lock, contextlib.ExitStack() as stack:
            for rt in self._runtimes:
                if rt.shared is not None:
                    stack.enter_context(rt.shared.read())
            yield


class DeltaFollowers:
    """The delta followers of a worker, one per served version; none until :meth:`follow`."""

    def __init__(self) -> None:
        self.followers: list[DeltaFollower] = []

    def follow(self, store: DeltaStore, wiring: DeltaWiring,
               versions: Sequence[tuple[str, Runtime]], lock: threading.Lock) -> None:
        """One follower per (model version, runtime) of ``versions``: every delta already
        in the store is applied now, later ones by a background thread polling every
        ``wiring.poll_s`` seconds, each under ``lock`` (serve.runtime.follower)."""
        for version, rt in versions:
            f = DeltaFollower(store, version, rt, lock)
            n = f.catch_up()
            f.write_status()
            f.start(wiring.poll_s)
            self.followers.append(f)
            logger.info("deltas: following %s in %s (%d applied at start, sequence %d, "
                        "shared tables %s)", version, store.folder(version), n, f.applied,
                        rt.shared.path if rt.shared is not None else "off")

    def close(self) -> None:
        """Stop the followers' threads."""
        for f in self.followers:
            f.stop()
