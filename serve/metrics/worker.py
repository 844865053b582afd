"""What a TorchServe worker records: :class:`HandlerMetrics` (one per worker process,
writing prometheus_client's multiprocess files; names in :mod:`serve.metrics`), and
:func:`observe_many`, a histogram's bulk observe for a batch's thousands of values.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve.constants import STAGES
from serve.metrics import (
    ARM_ERRORS_TOTAL,
    ARM_FORWARD_SECONDS_PER_INSTANCE,
    ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS,
    ARM_REQUEST_DURATION_SECONDS,
    ARM_REQUESTS_TOTAL,
    ARM_SCORE,
    ARMS,
    BATCH_INSTANCES,
    BATCH_INSTANCES_BUCKETS,
    BATCH_REQUESTS,
    BATCH_REQUESTS_BUCKETS,
    CACHE_DEVICE_BYTES,
    CACHE_EVICTIONS_TOTAL,
    CACHE_HITS_TOTAL,
    CACHE_HOST_BYTES,
    CACHE_MISSES_TOTAL,
    CAPACITY_WORK_SECONDS_TOTAL,
    EMBEDDING_IDS_FALLBACK_TOTAL,
    EMBEDDING_IDS_WRAPPED_TOTAL,
    INSTANCES_TOTAL,
    PREDICT_CPU_SECONDS_TOTAL,
    PREDICTION_LOG_RECORDS_TOTAL,
    REQUEST_DURATION_BUCKETS,
    REQUEST_DURATION_SECONDS,
    REQUESTS_TOTAL,
    REUSE_ACCESSES_TOTAL,
    REUSE_DISTANCE_BUCKETS,
    REUSE_DISTANCE_ROWS,
    REUSE_FIRST_ACCESSES_TOTAL,
    SCORE_BUCKETS,
    SCORE_DIFF_BUCKETS,
    SHADOW_SCORE_DIFF,
    STAGE_DURATION_BUCKETS,
    STAGE_DURATION_SECONDS,
    TIER_CAPACITY_BYTES,
    TIER_HITS_TOTAL,
    TIER_LOOKUPS_TOTAL,
    TIER_MISS_SECONDS,
    TIER_READ_BYTES_TOTAL,
    TIERS,
    strip_total,
)

__all__ = [
    "CacheStats",
    "HandlerMetrics",
    "ReuseMetrics",
    "TierStats",
    "observe_many",
]

_log = logging.getLogger(__name__)


class CacheStats(Protocol):
    """The part of ``serve.runtime.engine.RuntimeStats`` read here (cumulative since load)."""

    hits: int
    misses: int
    evictions: int
    device_bytes: int
    host_bytes: int


class TierStats(Protocol):
    """One tier's cumulative counters as the runtime reports them
    (``serve.runtime.rowsource.TierCounters``)."""

    @property
    def lookups(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def read_bytes(self) -> int: ...
    @property
    def miss_seconds_sum(self) -> float: ...
    @property
    def miss_seconds_count(self) -> int: ...
    @property
    def miss_seconds_bins(self) -> tuple[int, ...]: ...
    @property
    def capacity_bytes(self) -> int: ...


class HandlerMetrics:
    """What a TorchServe worker records; safe to call from the handler's thread.

    Args:
        registry: where the metric objects register. In multiprocess mode the values go
            to the mmap files in ``PROMETHEUS_MULTIPROC_DIR`` whatever the registry, so
            the default (None) is a private registry: it keeps a second instance in the
            same process (tests, a reloaded handler) from failing on duplicate names.
            Pass a fresh ``CollectorRegistry`` to read values in a single process.

    Do not use it in the sidecar: the sidecar reads the workers' files instead.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._requests = Counter(strip_total(REQUESTS_TOTAL), "Prediction requests answered "
                                 "by the handler, by HTTP status code.", ["code"], registry=r)
        self._instances = Counter(strip_total(INSTANCES_TOTAL), "Instances (samples) "
                                  "received in prediction requests of any status.", registry=r)
        self._duration = Histogram(
            REQUEST_DURATION_SECONDS,
            "Handler time per prediction request, decode to response, in seconds.",
            buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self._batch_instances = Histogram(
            BATCH_INSTANCES,
            "Instances per merged forward pass (all requests of one TorchServe batch).",
            buckets=BATCH_INSTANCES_BUCKETS, registry=r)
        self._work = Counter(
            strip_total(CAPACITY_WORK_SECONDS_TOTAL),
            "Seconds of model work done: each batch's handler time (decode to response), "
            "once per batch. rate() of it over the pod's capacity is the HPA's "
            "dlrm_capacity_utilization_ratio.", registry=r)
        self._predict_cpu = Counter(strip_total(PREDICT_CPU_SECONDS_TOTAL), "CPU seconds "
                                    "spent in the model's predict (lookups, dense part), by "
                                    "the worker thread's clock.", registry=r)
        self._batch_requests = Histogram(
            BATCH_REQUESTS,
            "Requests per forward pass: the TorchServe batch size actually formed.",
            buckets=BATCH_REQUESTS_BUCKETS, registry=r)
        self._logged = Counter(
            strip_total(PREDICTION_LOG_RECORDS_TOTAL),
            "Requests written to the prediction log (sampled) for joining click feedback.",
            registry=r)
        self._hits = Counter(strip_total(CACHE_HITS_TOTAL),
                             "Embedding rows found in the device cache.", registry=r)
        self._misses = Counter(strip_total(CACHE_MISSES_TOTAL),
                               "Embedding rows fetched from host memory.", registry=r)
        self._evictions = Counter(strip_total(CACHE_EVICTIONS_TOTAL),
                                  "Embedding rows evicted from the device cache.", registry=r)
        # livesum: the pod's total over live workers (the sidecar reaps dead ones).
        self._device_bytes = Gauge(CACHE_DEVICE_BYTES,
                                   "Embedding bytes held on the compute device.",
                                   registry=r, multiprocess_mode="livesum")
        self._host_bytes = Gauge(CACHE_HOST_BYTES,
                                 "Embedding bytes held in host memory.",
                                 registry=r, multiprocess_mode="livesum")
        self._wrapped = Counter(
            strip_total(EMBEDDING_IDS_WRAPPED_TOTAL),
            "Sparse ids >= their table's rows, wrapped modulo rows, per feature: new ids "
            "outgrowing a table.", ["feature"], registry=r)
        self._fallback = Counter(
            strip_total(EMBEDDING_IDS_FALLBACK_TOTAL),
            "Lookups of a managed feature whose id has no row of its own (never admitted, "
            "evicted, not admitted yet) and read the table's fallback row, per feature and "
            "model version.", ["feature", "version"], registry=r)
        self._stage = Histogram(
            STAGE_DURATION_SECONDS,
            "Time per pipeline stage of one forward pass, in seconds.",
            ["stage"], buckets=STAGE_DURATION_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        #: The wrapped-id counts last seen: almost every batch sees the same ones, and
        #: then :meth:`set_wrapped` has nothing to count (one label lookup per feature).
        self._wrapped_seen: tuple[int, ...] | None = None
        self._dropped_stages: set[str] = set()
        self._init_arms(r)
        #: The table tiers' series (serve.runtime.tiers).
        self.tiers = TierMetrics(r)

    def _init_arms(self, r: CollectorRegistry) -> None:
        """The per-arm series of rollouts (serve.store.routing): one per (arm, version);
        without a rollout the handler records everything as arm="stable" of its version."""
        arm_labels = ["arm", "version"]
        self._arm_requests = Counter(
            strip_total(ARM_REQUESTS_TOTAL),
            "Requests scored by each arm of a rollout (shadow candidate: scored, not "
            "answered); requests whose body was refused belong to no arm.",
            arm_labels, registry=r)
        self._arm_errors = Counter(
            strip_total(ARM_ERRORS_TOTAL),
            "Requests of an arm whose forward raised (any exception of that model).",
            arm_labels, registry=r)
        self._arm_duration = Histogram(
            ARM_REQUEST_DURATION_SECONDS,
            "Seconds per request of an arm: the batch's decode time plus that arm's "
            "forward time.",
            arm_labels, buckets=REQUEST_DURATION_BUCKETS, registry=r)
        self._arm_forward = Histogram(
            ARM_FORWARD_SECONDS_PER_INSTANCE,
            "Forward seconds per instance of an arm: one observation per forward that "
            "succeeded (its forward time / its instances; decode and queue excluded).",
            arm_labels, buckets=ARM_FORWARD_SECONDS_PER_INSTANCE_BUCKETS, registry=r)
        self._arm_score = Histogram(
            ARM_SCORE,
            "Predicted click probabilities of each arm, one observation per instance.",
            arm_labels, buckets=SCORE_BUCKETS, registry=r)
        self._shadow_diff = Histogram(
            SHADOW_SCORE_DIFF,
            "Shadow mode: candidate minus stable predicted probability on the same "
            "instance, one observation per instance.",
            ["version"], buckets=SCORE_DIFF_BUCKETS, registry=r)

    def observe_request(self, code: int, instances: int, seconds: float) -> None:
        """One answered request: its HTTP ``code``, ``instances`` in it (0 when the body
        did not parse) and the handler's time for it in ``seconds``."""
        self.observe_requests(code, 1, instances, seconds)

    def observe_requests(self, code: int, requests: int, instances: int,
                         seconds: float) -> None:
        """``requests`` answered requests of one batch with the same HTTP ``code``,
        ``instances`` in all, each taking ``seconds`` of handler time: the same series as
        that many :meth:`observe_request` calls, with one write per series (a batch of
        32 single-instance requests made 96 locked mmap writes)."""
        code = int(code)
        if not 100 <= code <= 599:
            raise ValueError(f"HTTP code {code} is outside 100..599; pass the status sent")
        if requests < 1:
            raise ValueError(f"requests={requests} must be >= 1")
        if instances < 0 or seconds < 0:
            raise ValueError(f"instances={instances} and seconds={seconds} must be >= 0")
        self._requests.labels(code=str(code)).inc(requests)
        if instances:
            self._instances.inc(instances)
        if requests == 1:
            self._duration.observe(float(seconds))
        else:
            observe_many(self._duration, np.full(requests, float(seconds)))

    def observe_work(self, seconds: float) -> None:
        """One batch's handler time in ``seconds`` (the work it cost the worker, whatever
        its requests' sizes or statuses): :data:`CAPACITY_WORK_SECONDS_TOTAL`."""
        if not seconds >= 0:
            raise ValueError(f"work seconds={seconds} must be >= 0; pass the batch's "
                             "measured handler time")
        self._work.inc(float(seconds))

    def observe_predict_cpu(self, seconds: float) -> None:
        """CPU ``seconds`` spent in predict since the last call (below 0: none)."""
        self._predict_cpu.inc(max(0.0, float(seconds)))

    def observe_batch(self, instances: int, requests: int) -> None:
        """One merged forward pass over ``instances`` samples from ``requests`` requests."""
        if instances < 0 or requests < 1:
            raise ValueError(
                f"instances={instances} must be >= 0 and requests={requests} >= 1")
        self._batch_instances.observe(instances)
        self._batch_requests.observe(requests)

    def observe_stages(self, seconds: Mapping[str, float]) -> None:
        """Per-forward stage times (deltas, seconds) keyed by ``"decode"``, ``"embedding"``,
        ``"dense"``. Other keys are dropped (logged once) to keep labels bounded: a metrics
        call must never fail a prediction."""
        for stage, value in seconds.items():
            if stage not in STAGES:
                if stage not in self._dropped_stages:
                    self._dropped_stages.add(stage)
                    _log.warning("stage %r is not one of %s; not recorded", stage, STAGES)
                continue
            self._stage.labels(stage=stage).observe(max(0.0, float(value)))

    def set_cache(self, stats: CacheStats) -> None:
        """Record the runtime's cumulative cache statistics after a forward pass.

        Counters move by the delta since the previous call; a value lower than the last
        one means the runtime was rebuilt, and counts from zero again (as Prometheus
        treats a counter reset).
        """
        with self._lock:
            for key, counter in (("hits", self._hits), ("misses", self._misses),
                                 ("evictions", self._evictions)):
                self._advance(counter, key, int(getattr(stats, key)))
            self._device_bytes.set(int(stats.device_bytes))
            self._host_bytes.set(int(stats.host_bytes))

    def skip_cache(self, stats: CacheStats, features: list[str],
                   wrapped: tuple[int, ...]) -> None:
        """Take the runtime's cumulative counts as the starting point without counting
        them (the worker's warm-up forwards before it serves): the next :meth:`set_cache`
        and :meth:`set_wrapped` count only what came after (:meth:`set_fallback` with
        ``count=False`` does the same for the fallback counts)."""
        with self._lock:
            for key in ("hits", "misses", "evictions"):
                self._last[key] = int(getattr(stats, key))
            for name, value in zip(features, wrapped, strict=True):
                self._last[f"wrapped:{name}"] = int(value)
                self._wrapped.labels(feature=name)  # the series exist, at 0, from here
            self._wrapped_seen = tuple(wrapped)

    def set_wrapped(self, features: list[str], wrapped: tuple[int, ...]) -> None:
        """Record a runtime's cumulative wrapped-id counts (``RuntimeStats.wrapped``, one
        per feature in ``features`` order) as counter increments, like :meth:`set_cache`."""
        with self._lock:
            now = tuple(wrapped)
            if now == self._wrapped_seen:
                return
            for name, value in zip(features, now, strict=True):
                key = f"wrapped:{name}"
                if self._last.get(key) != value:    # only the features that moved
                    self._advance(self._wrapped.labels(feature=name), key, int(value))
            self._wrapped_seen = now

    def set_fallback(self, version: str, features: list[str], fallback: tuple[int, ...],
                     managed: frozenset[str] | None = None, *, count: bool = True) -> None:
        """Record the cumulative fallback-row lookups of ``version``'s runtime
        (``RuntimeStats.fallback``, one per feature in ``features`` order) as counter
        increments, like :meth:`set_wrapped`. ``managed``: the features whose series
        exist (those of managed tables; None: every feature); a modulo feature never reads
        a fallback row, so it gets no series of zeros. ``count=False``: take the counts as
        the starting point without counting them (warm-up), creating the series at 0."""
        with self._lock:
            for name, value in zip(features, fallback, strict=True):
                if managed is not None and name not in managed:
                    continue
                child = self._fallback.labels(feature=name, version=version)
                key = f"fallback:{version}:{name}"
                if count:
                    self._advance(child, key, int(value))
                else:
                    self._last[key] = int(value)

    def set_tiers(self, tiers: Mapping[str, TierStats], *, count: bool = True) -> None:
        """:meth:`TierMetrics.set_tiers` (the table tiers' series)."""
        self.tiers.set_tiers(tiers, count=count)

    def _advance(self, counter: Counter, key: str, value: int) -> None:
        """Move ``counter`` by ``value``'s increase since the last value seen under ``key``
        (a lower value: the runtime was rebuilt and counts from zero again). Under _lock."""
        last = self._last.get(key, 0)
        self._last[key] = value
        delta = value - last if value >= last else value
        if delta:
            counter.inc(delta)

    def observe_logged(self, requests: int) -> None:
        """``requests`` more requests written to the prediction log (serve.store.predlog)."""
        if requests < 0:
            raise ValueError(f"requests={requests} must be >= 0")
        self._logged.inc(requests)

    def observe_arm(self, arm: str, version: str, requests: int, errors: int,
                    seconds_per_request: float, scores: np.ndarray | None = None, *,
                    forward_seconds_per_instance: float | None = None) -> None:
        """One arm's forward in a batch.

        Args:
            arm: ``stable`` or ``candidate`` (:data:`ARMS`).
            version: the model version of that arm (label ``version``).
            requests: requests the arm scored (answered, or shadow-scored).
            errors: how many of them failed (all of them when its forward raised).
            seconds_per_request: the batch's decode time + the arm's forward time, in
                seconds; observed once per request in ``dlrm_arm_request_duration_seconds``.
            scores: (n,) the predicted probabilities of the arm's instances, one
                ``dlrm_arm_score`` observation each (None or empty: none).
            forward_seconds_per_instance: the arm's forward seconds / its instances,
                observed once in ``dlrm_arm_forward_seconds_per_instance`` (None: not
                observed; pass None for a forward that failed).
        Raises:
            ValueError: an arm outside ARMS, an empty version, counts below 0 or errors
                above requests, a negative or non-finite duration.

        Both counters get their series even when they do not move, so that an error
        ratio reads 0/n, not "no data".
        """
        _check_arm(arm, version)
        if requests < 0 or not 0 <= errors <= requests:
            raise ValueError(f"requests={requests} must be >= 0 and errors={errors} in "
                             "0..requests")
        for what, secs in (("seconds_per_request", seconds_per_request),
                           ("forward_seconds_per_instance", forward_seconds_per_instance)):
            if secs is not None and (not math.isfinite(secs) or secs < 0):
                raise ValueError(f"{what}={secs} must be finite and >= 0")
        self._arm_requests.labels(arm=arm, version=version).inc(requests)
        self._arm_errors.labels(arm=arm, version=version).inc(errors)
        if requests:
            observe_many(self._arm_duration.labels(arm=arm, version=version),
                         np.full(requests, float(seconds_per_request)))
        if forward_seconds_per_instance is not None:
            self._arm_forward.labels(arm=arm, version=version).observe(
                float(forward_seconds_per_instance))
        if scores is not None and np.size(scores):
            observe_many(self._arm_score.labels(arm=arm, version=version), scores)

    def observe_shadow_diff(self, version: str, diffs: np.ndarray) -> None:
        """Shadow mode: ``diffs`` (n,) = candidate minus stable score per instance, for
        the candidate ``version``; one ``dlrm_shadow_score_diff`` observation each."""
        _check_arm("candidate", version)
        if np.size(diffs):
            observe_many(self._shadow_diff.labels(version=version), diffs)


class ReuseMetrics:
    """The capacity advisor's series of one worker (:mod:`serve.common.reuse`): the
    sampled accesses' LRU stack depths in ``dlrm_reuse_distance_rows`` and the sampled
    first accesses in ``dlrm_reuse_first_accesses_total``, each sampled access weighted
    by ``1 / R`` (the accesses it stands for), so the histogram's ``_count`` plus the
    first accesses estimate every access of the stream and the rate may change (the
    fixed-size sampler lowers it) without biasing the curve.

    Args:
        registry: where they register (pass :attr:`HandlerMetrics.registry`; in
            multiprocess mode the values go to the mmap files whatever the registry).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._depth = Histogram(
            REUSE_DISTANCE_ROWS,
            "LRU stack depth, in table rows, of sampled row accesses whose row was seen "
            "before (the smallest LRU cache that still holds the row when it comes back), "
            "each weighted by 1/R (the accesses it stands for).",
            buckets=REUSE_DISTANCE_BUCKETS, registry=registry)
        self._first = Counter(
            strip_total(REUSE_FIRST_ACCESSES_TOTAL),
            "Sampled row accesses whose row was new to the sampler (cold misses), each "
            "weighted by 1/R.", registry=registry)
        self._accesses = Counter(
            strip_total(REUSE_ACCESSES_TOTAL),
            "Row accesses the reuse sampler saw, sampled or not.", registry=registry)

    def observe(self, depths: np.ndarray, first: int, weight: float, accesses: int) -> None:
        """``depths`` float (k,) in rows (>= 1), ``first`` cold accesses, each standing
        for ``weight`` (>= 1) accesses, out of ``accesses`` row accesses in all."""
        if not weight >= 1.0 or first < 0 or accesses < 0:
            raise ValueError(f"weight={weight} must be >= 1, first={first} and "
                             f"accesses={accesses} >= 0")
        if accesses:
            self._accesses.inc(accesses)
        if first:
            self._first.inc(first * weight)
        v = np.asarray(depths, dtype=np.float64).reshape(-1)
        if not v.size:
            return
        child = self._depth
        bounds = np.asarray(child._upper_bounds, dtype=np.float64)
        counts = np.bincount(np.searchsorted(bounds, v, side="left"), minlength=bounds.size)
        # observe_many's internals, with a weight per observation.
        for i in np.flatnonzero(counts):
            child._buckets[i].inc(float(counts[i]) * weight)
        child._sum.inc(float(v.sum()) * weight)


class TierMetrics:
    """The table tiers' series of a worker (label ``tier`` in :data:`TIERS`): ids looked
    up and found per tier, bytes fetched from the tier below, the fetches' seconds, the
    tiers' capacity. Part of :class:`HandlerMetrics`.
    """

    def __init__(self, r: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._last_miss: dict[str, tuple[int, float, tuple[int, ...]]] = {}
        self._tier_lookups = Counter(
            strip_total(TIER_LOOKUPS_TOTAL),
            "Sparse ids looked up at a table tier (device: every id of a batch when the "
            "device cache serves; host: the ids the tier above missed).", ["tier"],
            registry=r)
        self._tier_hits = Counter(strip_total(TIER_HITS_TOTAL),
                                  "Ids found resident in a table tier.", ["tier"], registry=r)
        self._tier_read = Counter(
            strip_total(TIER_READ_BYTES_TOTAL),
            "Bytes a table tier fetched from the tier below (host: read from the table "
            "files on disk).", ["tier"], registry=r)
        self._tier_miss = Histogram(
            TIER_MISS_SECONDS,
            "Seconds a table tier spent fetching one lookup's misses from the tier below.",
            ["tier"], buckets=STAGE_DURATION_BUCKETS, registry=r)
        self._tier_capacity = Gauge(TIER_CAPACITY_BYTES,
                                    "Row budget of a table tier in bytes (0: no such tier).",
                                    ["tier"], registry=r, multiprocess_mode="livesum")

    def set_tiers(self, tiers: Mapping[str, TierStats], *, count: bool = True) -> None:
        """Record the runtimes' cumulative tier counters (``RuntimeStats.tiers``, summed
        over a worker's runtimes) as increments, like :meth:`set_cache`; tiers outside
        :data:`TIERS` are dropped (bounded labels). ``count=False``: take them as the
        starting point without counting them (warm-up); the capacity gauge is set
        either way."""
        with self._lock:
            for tier in TIERS:
                s = tiers.get(tier)
                if s is None:
                    continue
                for name, counter, value in (("lookups", self._tier_lookups, s.lookups),
                                             ("hits", self._tier_hits, s.hits),
                                             ("read", self._tier_read, s.read_bytes)):
                    key = f"tier:{tier}:{name}"
                    last = self._last.get(key, 0)
                    self._last[key] = int(value)
                    # a lower value: the runtime was rebuilt and counts from zero again
                    delta = int(value) - last if value >= last else int(value)
                    if count and delta:
                        counter.labels(tier=tier).inc(delta)
                now = (int(s.miss_seconds_count), float(s.miss_seconds_sum),
                       tuple(int(b) for b in s.miss_seconds_bins))
                seen = self._last_miss.get(tier)
                self._last_miss[tier] = now
                if count:
                    _advance_histogram(self._tier_miss.labels(tier=tier), now, seen)
                self._tier_capacity.labels(tier=tier).set(int(s.capacity_bytes))


def _check_arm(arm: str, version: str) -> None:
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r} is not one of {ARMS}")
    if not isinstance(version, str) or not version:
        raise ValueError(f"version {version!r} must be a non-empty model version")


def _advance_histogram(child: Histogram, now: tuple[int, float, tuple[int, ...]],
                       last: tuple[int, float, tuple[int, ...]] | None) -> None:
    """Move a histogram child by the observations a cumulative ``(count, sum, bins)``
    gained since ``last`` (None, or a lower count: counted from zero again, a rebuilt
    runtime). Uses the internals :func:`observe_many` uses (checked there)."""
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    count, seconds, bins = now
    if buckets is None or total is None or len(buckets) != len(bins):
        raise TypeError(f"tier miss histogram: {len(bins)} bins against "
                        f"{len(buckets) if buckets is not None else 'no'} buckets; the "
                        "runtime's MISS_SECONDS_BUCKETS and the metric's buckets differ")
    if last is None or count < last[0]:
        last = (0, 0.0, (0,) * len(bins))
    for i, (a, b) in enumerate(zip(bins, last[2], strict=True)):
        if a > b:
            buckets[i].inc(a - b)
    if seconds > last[1]:
        total.inc(seconds - last[1])


def observe_many(histogram: Histogram, values: np.ndarray) -> int:
    """Add each of ``values`` as one observation of ``histogram``, exactly as a loop of
    ``histogram.observe(v)`` would, with one write per non-empty bucket instead of one
    per value.

    Why: a batch holds up to thousands of instances, and in multiprocess mode every
    ``observe`` takes a lock and writes the mmap file. prometheus_client has no bulk
    call, so this uses the internals ``Histogram.observe`` itself uses: the child's
    ``_upper_bounds`` (the buckets, +Inf last), ``_buckets`` (one value per bucket,
    counts NOT cumulative) and ``_sum``, plus ``_raise_if_not_observable``. Checked
    against prometheus_client 0.26.0 (the version in .venv);
    ``tests/test_metrics.py`` compares the exposition with a loop of ``observe()``, so an
    upgrade that changes them fails there.

    Binning: ``np.searchsorted(bounds, v, side="left")`` is the first bucket whose bound
    is >= v: prometheus' ``le`` (v <= bound). NaN values are skipped: ``observe`` would
    count them in no bucket and turn the sum into NaN for good.

    Args:
        histogram: a Histogram without labels, or a labelled child (``h.labels(...)``).
        values: any shape (flattened), any real dtype.
    Returns:
        The number of observations added.
    Raises:
        TypeError: ``histogram`` is not a prometheus_client Histogram (or its internals
            changed).
        ValueError: ``histogram`` is a labelled parent (call ``.labels(...)`` first).
    """
    if not hasattr(histogram, "_upper_bounds") or not hasattr(histogram,
                                                              "_raise_if_not_observable"):
        raise TypeError(f"observe_many needs a prometheus_client Histogram (child), got "
                        f"{type(histogram).__name__}")
    histogram._raise_if_not_observable()
    buckets, total = getattr(histogram, "_buckets", None), getattr(histogram, "_sum", None)
    if buckets is None or total is None or len(buckets) != len(histogram._upper_bounds):
        raise TypeError("observe_many: this prometheus_client's Histogram internals differ "
                        "from 0.26.0 (_buckets/_sum); update observe_many")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[~np.isnan(v)]
    if not v.size:
        return 0
    bounds = np.asarray(histogram._upper_bounds, dtype=np.float64)
    counts = np.bincount(np.searchsorted(bounds, v, side="left"), minlength=bounds.size)
    for i in np.flatnonzero(counts):
        buckets[i].inc(int(counts[i]))
    total.inc(float(v.sum()))
    return int(v.size)
