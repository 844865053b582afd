"""What a worker records of each batch: the handler metrics and the prediction log.

* :class:`BatchRecorder`: the handler metrics (:class:`serve.metrics.HandlerMetrics`) of a
  batch: requests by status, the batch's work seconds, the per-arm series, the stage
  seconds and the cache counters summed over the worker's runtimes. It owns the
  starting points those cumulative counters are measured from (reset after the warm-up,
  so the warm-up counts nowhere).
* :class:`PredictionRecorder`: every scored request of a batch into the prediction log
  (:mod:`serve.store.predlog`), keyed by its request id.
* :class:`ReuseRecorder`: the capacity advisor's sample of the stable model's id stream
  (:mod:`serve.common.reuse`) into :class:`serve.metrics.worker.ReuseMetrics`.

Neither ever fails a prediction: a failure is logged with its traceback.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from serve.api.batch import Outcome
from serve.common.reuse import ReuseSampler
from serve.common.validate import number_in_range
from serve.errors import ConfigError
from serve.metrics.worker import HandlerMetrics, ReuseMetrics
from serve.runtime.engine import RuntimeStats
from serve.runtime.rowsource import TierCounters
from serve.schema import ModelSchema
from serve.settings import DLRM_REUSE_SAMPLE
from serve.store.predlog import Prediction, PredictionLogWriter
from serve.worker.arms import Arms, BatchInfo

__all__ = ["BatchRecorder", "CacheTotals", "PredictionRecorder", "ReuseRecorder",
           "reuse_sample_from_env"]

logger = logging.getLogger(__name__)


@dataclass
class CacheTotals:
    """Cache statistics summed over the runtimes (stable + candidate), in the shape
    :meth:`HandlerMetrics.set_cache` reads, plus ``wrapped`` per feature (for
    ``set_wrapped``) and each runtime's ``fallback`` per feature by model version (for
    ``set_fallback``); sums of cumulative counts stay cumulative."""

    hits: int
    misses: int
    evictions: int
    device_bytes: int
    host_bytes: int
    wrapped: tuple[int, ...]
    fallback: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Per tier ("device", "host"), its counters summed over the runtimes.
    tiers: dict[str, TierCounters] = field(default_factory=dict)


class BatchRecorder:
    """The handler metrics of a worker's batches, over the runtimes of ``arms``.

    Creating one makes the fallback-row series exist (at 0) before the first fallback,
    so ``rate()`` works from the start.
    """

    def __init__(self, arms: Arms, metrics: HandlerMetrics) -> None:
        self.arms = arms
        self.metrics = metrics
        self.restart_stages()
        #: Per version, the features of managed tables: they get fallback-row series.
        self._managed = self._managed_features()
        self._record_fallback(self._cache_stats(), count=False)

    def restart_stages(self) -> None:
        """Measure the stage seconds (and predict's CPU seconds) from the runtimes'
        counters as they are now."""
        snapshot = self._snapshot()
        self._last_stages = self._stage_seconds(snapshot)
        self._last_cpu = sum(st.predict_cpu_seconds for _, st in snapshot)

    def start_here(self) -> None:
        """Take the runtimes' counters as they are now as the starting point (after the
        warm-up: it counts in no metric)."""
        self.restart_stages()
        stats = self._cache_stats()
        self.metrics.skip_cache(stats, self.arms.stable.feature_names, stats.wrapped)
        self.metrics.set_tiers(stats.tiers, count=False)
        self._record_fallback(stats, count=False)

    def record(self, outcomes: Sequence[Outcome], info: BatchInfo | None,
               seconds: float) -> None:
        """One batch: its ``outcomes``, what it did (``info``; None: it failed as a whole)
        and its ``seconds``. Never raises (logged)."""
        try:
            # The batch's time once (every request's histogram sample repeats it): the
            # work the HPA's utilization signal counts, failed batches included.
            self.metrics.observe_work(seconds)
            if info is not None:
                self.arms.stable.record_stage("decode", info.decode_s)
            by_status: dict[int, list[int]] = {}  # status -> [requests, instances]
            for out in outcomes:
                tally = by_status.setdefault(out.status, [0, 0])
                tally[0] += 1
                tally[1] += out.instances
            for status, (requests, instances) in by_status.items():
                self.metrics.observe_requests(status, requests, instances, seconds)
            if info is None:
                return
            self._record_arms(info)
            if info.requests:
                self._record_forward(info)
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording DLRM metrics failed")

    def _record_forward(self, info: BatchInfo) -> None:
        """The batch's size, the stage seconds since the last batch and the caches."""
        self.metrics.observe_batch(info.instances, info.requests)
        snapshot = self._snapshot()  # one stats() per runtime and batch, for both below
        now = self._stage_seconds(snapshot)
        self.metrics.observe_stages({k: v - self._last_stages.get(k, 0.0)
                                     for k, v in now.items()})
        self._last_stages = now
        cpu = sum(st.predict_cpu_seconds for _, st in snapshot)
        self.metrics.observe_predict_cpu(cpu - self._last_cpu)
        self._last_cpu = cpu
        stats = self._cache_stats(snapshot)
        self.metrics.set_cache(stats)
        self.metrics.set_tiers(stats.tiers)
        self.metrics.set_wrapped(self.arms.stable.feature_names, stats.wrapped)
        self._record_fallback(stats)

    def _record_arms(self, info: BatchInfo) -> None:
        """Per-arm series: each arm that ran a forward, with its model version; every
        request of a failed forward is an error of its arm. Seconds per request = the
        batch's decode time + the arm's forward time; forward seconds per instance (what
        the rollout's latency guard compares) = the arm's forward time / its instances,
        for forwards that succeeded."""
        try:
            for run in info.arms.values():
                per_instance = (run.forward_s / run.instances
                                if not run.failed and run.instances else None)
                self.metrics.observe_arm(
                    run.arm, self.arms.version_of(run.arm), run.requests,
                    run.requests if run.failed else 0, info.decode_s + run.forward_s,
                    run.scores, forward_seconds_per_instance=per_instance)
            candidate_version = self.arms.candidate_version
            if info.shadow_diff is not None and candidate_version is not None:
                self.metrics.observe_shadow_diff(candidate_version, info.shadow_diff)
        except Exception:  # metrics must never fail a prediction
            logger.exception("recording the per-arm DLRM metrics failed")

    def _snapshot(self) -> list[tuple[str, RuntimeStats]]:
        """(model version, its runtime's counters now), stable first."""
        return [(version, rt.stats()) for version, rt in self.arms.versions()]

    def _stage_seconds(self, snapshot: list[tuple[str, RuntimeStats]] | None = None
                       ) -> dict[str, float]:
        """Cumulative seconds per stage, summed over the worker's runtimes."""
        total: dict[str, float] = {}
        for _, st in snapshot if snapshot is not None else self._snapshot():
            for k, v in st.stage_seconds.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def _cache_stats(self, snapshot: list[tuple[str, RuntimeStats]] | None = None
                     ) -> CacheTotals:
        """Cache statistics summed over the runtimes (stable + candidate)."""
        names = ("hits", "misses", "evictions", "device_bytes", "host_bytes")
        total = dict.fromkeys(names, 0)
        wrapped = [0] * len(self.arms.stable.feature_names)
        fallback: dict[str, tuple[int, ...]] = {}
        tiers: dict[str, TierCounters] = {}
        for version, st in snapshot if snapshot is not None else self._snapshot():
            for tier, c in st.tiers.items():
                tiers[tier] = tiers[tier].plus(c) if tier in tiers else c
            for name in names:
                total[name] += int(getattr(st, name))
            for i, n in enumerate(st.wrapped):
                wrapped[i] += n
            if self._managed.get(version):
                fallback[version] = st.fallback
        return CacheTotals(**total, wrapped=tuple(wrapped), fallback=fallback, tiers=tiers)

    def _managed_features(self) -> dict[str, frozenset[str]]:
        """Per model version, the features that read a managed table
        (serve.runtime.idmap): the ones with ``dlrm_embedding_ids_fallback_total``
        series (a version without any is left out)."""
        out: dict[str, frozenset[str]] = {}
        for version, rt in self.arms.versions():
            tables = rt.schema.tables
            names = frozenset(f.name for f, t in zip(rt.schema.features,
                                                     rt.schema.feature_tables, strict=True)
                              if tables[t].mapping == "managed")
            if names:
                out[version] = names
        return out

    def _record_fallback(self, stats: CacheTotals, *, count: bool = True) -> None:
        """Each runtime's fallback lookups under its model version (``count=False``: the
        starting point, after the warm-up)."""
        for version, fallback in stats.fallback.items():
            self.metrics.set_fallback(version, self.arms.stable.feature_names, fallback,
                                      self._managed[version], count=count)


class PredictionRecorder:
    """Writes every scored request of a batch into the prediction log.

    Args:
        writer: the prediction log.
        version_of: arm -> the model version that scored it (:meth:`Arms.version_of`).
        metrics: counts the entries written (``observe_logged``).
        wall: epoch seconds, the entries' time.
    """

    def __init__(self, writer: PredictionLogWriter, version_of: Callable[[str | None], str],
                 metrics: HandlerMetrics, wall: Callable[[], float] = time.time) -> None:
        self.writer = writer
        self._version_of = version_of
        self._metrics = metrics
        self._wall = wall

    def record(self, info: BatchInfo, request_ids: Sequence[str | None]) -> None:
        """Every scored request of the batch (answered, or shadow-scored: arm
        ``candidate``) into the prediction log, keyed by its request id (``request_ids``
        in batch order; None: not logged). Never fails a prediction: logged."""
        try:
            now, preds = self._wall(), []
            for run in info.arms.values():
                if run.scores is None:
                    continue
                version, start = self._version_of(run.arm), 0
                for idx, size in zip(run.indices, run.sizes, strict=True):
                    rid = request_ids[idx]
                    if rid:
                        preds.append(Prediction(str(rid), version, run.arm, now,
                                                run.scores[start:start + size]))
                    start += size
            written = self.writer.write(preds)
            if written:
                self._metrics.observe_logged(written)
        except Exception:  # the log must never fail a prediction
            logger.exception("writing the prediction log failed")


def reuse_sample_from_env(environ: Mapping[str, str]) -> float:
    """The reuse sampler's rate R from ``DLRM_REUSE_SAMPLE`` (0: off), read once where a
    worker loads.

    Raises:
        ConfigError: not a number in [0, 1].
    """
    raw = DLRM_REUSE_SAMPLE.get(environ)
    try:
        value = float(raw) if raw is not None else 0.0
    except ValueError:
        raise ConfigError(f"{DLRM_REUSE_SAMPLE}={raw!r} is not a number; set a share of "
                          "rows in [0, 1] (0 turns the sampler off)") from None
    return number_in_range(str(DLRM_REUSE_SAMPLE), value, 0.0, 1.0,
                           then=" (0 turns the sampler off)")


class ReuseRecorder:
    """Samples the ids of a model's forwards (:class:`serve.common.reuse.ReuseSampler`)
    and records their reuse distances (:class:`ReuseMetrics`). The sampler keys a row by
    (its table, the id as sent): an id past its table's rows (wrapped modulo rows, rare:
    ``dlrm_embedding_ids_wrapped_total``) counts as a row of its own.

    Args:
        schema: the model's schema (which table each feature reads).
        rate: R in (0, 1] (:func:`reuse_sample_from_env`).
        metrics: where the distances go.
        max_rows: most rows the sampler tracks.
    """

    def __init__(self, schema: ModelSchema, rate: float, metrics: ReuseMetrics,
                 max_rows: int = 16384) -> None:
        self.sampler = ReuseSampler(rate, max_rows=max_rows)
        self.metrics = metrics
        self._feature_tables = np.asarray(schema.feature_tables, dtype=np.int64)

    def observe(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """One forward's ids: ``values`` int64 (nnz,) feature-major, ``lengths`` int32
        (F, B). Never raises (logged): metrics must never fail a prediction."""
        try:
            tables = np.repeat(self._feature_tables, lengths.sum(axis=1))
            out = self.sampler.observe(tables, values)
            self.metrics.observe(out.depths, out.first, out.weight, out.accesses)
        except Exception:
            logger.exception("sampling reuse distances failed")
