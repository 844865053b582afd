"""GET /state's ``observed.tables``: the table tiers' hit rates, read from the workers'
metrics (:func:`serve.metrics.aggregate.tier_totals`) as the sidecar reads the rest.

:class:`TierWindow` owns the recent window: its loop (:meth:`TierWindow.run`, started by
the composition root) samples the workers' cumulative tier counters every
``interval_s`` and keeps those of the last ``window_s``; :meth:`TierWindow.view` (GET
/state) reads the counters now and differences them against the oldest sample kept, and
changes nothing. Before the loop's first sample the view is cumulative (``window_s``
null).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from serve.common.histograms import histogram_quantile
from serve.metrics.aggregate import TierTotals, tier_totals
from serve.sidecar.control.views import ObservedTables, TierStatus

__all__ = ["TierWindow", "observed_tables"]

_log = logging.getLogger(__name__)


def _miss_p99(now: TierTotals, before: TierTotals | None) -> float | None:
    """p99 of the miss-fetch histogram's increase since ``before`` (None: cumulative)."""
    bounds = sorted(now.miss_buckets)
    if not bounds:
        return None
    prev = before.miss_buckets if before is not None else {}
    counts = [now.miss_buckets[b] - prev.get(b, 0.0) for b in bounds]
    counts.append(now.miss_count - (before.miss_count if before is not None else 0.0))
    if counts[-1] <= 0 or any(c < 0 for c in counts):
        return None
    q = histogram_quantile(0.99, bounds, counts)
    return q if q is not None and math.isfinite(q) else None


def _tier(now: TierTotals, before: TierTotals | None, seconds: float | None) -> TierStatus:
    lookups = now.lookups - (before.lookups if before is not None else 0.0)
    hits = now.hits - (before.hits if before is not None else 0.0)
    read = now.read_bytes - (before.read_bytes if before is not None else 0.0)
    return TierStatus(
        hit_ratio=hits / lookups if lookups > 0 else None,
        lookups=int(lookups), hits=int(hits),
        miss_p99_s=_miss_p99(now, before),
        read_bytes_per_s=read / seconds if seconds else None,
        capacity_bytes=int(now.capacity_bytes) if now.capacity_bytes is not None else None,
        hit_ratio_total=now.hits / now.lookups if now.lookups > 0 else None,
        lookups_total=int(now.lookups))


def observed_tables(now: dict[str, TierTotals], before: dict[str, TierTotals] | None,
                    seconds: float | None) -> ObservedTables | None:
    """``observed.tables`` from the tiers' totals ``now`` and, for the windowed fields,
    those ``seconds`` earlier (``before``; None: cumulative). None when no tier reports.
    A window in which a counter went back (files replaced) falls back to cumulative."""
    if not now:
        return None
    if before is not None and any(
            t in before and (now[t].lookups < before[t].lookups
                             or now[t].read_bytes < before[t].read_bytes) for t in now):
        before, seconds = None, None
    if before is None or not seconds or seconds <= 0:
        before, seconds = None, None
    base = before or {}
    return ObservedTables(
        window_s=round(seconds, 3) if seconds else None,
        **{t: _tier(v, base.get(t) if before is not None else None, seconds)
           for t, v in now.items()})


class TierWindow:
    """The recent window of the tiers' counters (see the module docstring).

    Args:
        families: the workers' metric families now (the aggregate collector's
            ``collect``).
        window_s: how far back the windowed fields reach (the oldest sample kept).
        interval_s: between two samples of the loop.
        clock: monotonic seconds.
    """

    def __init__(self, families: Callable[[], Iterable[Metric]], *, window_s: float = 60.0,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < interval_s <= window_s:
            raise ValueError(f"interval_s={interval_s} must be in (0, window_s={window_s}]")
        self._families = families
        self.window_s = window_s
        self.interval_s = interval_s
        self._clock = clock
        self._samples: deque[tuple[float, dict[str, TierTotals]]] = deque()

    def read(self) -> dict[str, TierTotals]:
        """The tiers' totals now (reads the workers' files; no state)."""
        return tier_totals(self._families())

    def sample(self) -> None:
        """Keep the totals now; drop samples older than the window (the loop's step)."""
        now, totals = self._clock(), self.read()
        self._samples.append((now, totals))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def view(self) -> ObservedTables | None:
        """``observed.tables``: the totals now against the oldest sample kept (no
        sample: cumulative). Changes nothing."""
        now, totals = self._clock(), self.read()
        oldest = self._samples[0] if self._samples else None
        if oldest is None or now - oldest[0] < self.interval_s:  # too short to judge
            return observed_tables(totals, None, None)
        return observed_tables(totals, oldest[1], now - oldest[0])

    async def run(self) -> None:
        """Sample every ``interval_s`` until cancelled (a failed read is logged)."""
        while True:
            try:
                await asyncio.to_thread(self.sample)
            except Exception:  # noqa: BLE001 - a read racing a worker's write must not end the loop
                _log.exception("sampling the table tiers' counters failed")
            await asyncio.sleep(self.interval_s)
