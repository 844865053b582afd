"""Click feedback joined with the pod's own predictions: online CTR, calibration and AUC.

``POST /feedback`` takes labels for earlier predictions, ``{"labels": [{"request_id",
"index", "label"}]}`` (the request id is the ``x-request-id`` TorchServe put on the
prediction's response, the index the instance's position in that request). The sidecar
joins each label with the score the model gave, read from the prediction log that the
workers write (:mod:`serve.store.predlog`), and keeps the labelled predictions per version and
arm in a sliding window (:class:`CalibrationWindow`). From the window it exports the
observed CTR, the mean predicted CTR, their ratio (the calibration ratio, 1.0 = calibrated),
the normalized entropy and the AUC, beside the version's build-time baseline from its
report.

Beside the window, per (version, arm) it counts every label it joined since it started
(:class:`QualityTotals`: rows, clicks, sum of scores, sum of log losses and of their
squares), exported as COUNTERS (``dlrm_online_rows_total``, ``dlrm_online_clicks_total``,
``dlrm_online_score_total``, ``dlrm_online_logloss_nats_total``,
``dlrm_online_logloss_sq_nats2_total``). They are what a rollout's click-quality gates
judge (:mod:`serve.sidecar.control.quality_gates`): counters, not window sums, so that the
rollout takes exactly the labels joined since it started (its base snapshot subtracted,
as for the workers' counters) whatever the window's length, and a fleet sums them over
pods.

What happens to each label (``dlrm_feedback_labels_total{result}``):

* ``joined``: found; it enters the window of its version and arm (in shadow mode the
  stable answer AND the candidate's shadow score are both labelled);
* ``unknown``: the id was never logged here (not sampled, answered by another pod, or
  older than the index remembers);
* ``expired``: it was logged, but its file has been deleted (the log is bounded);
* ``duplicate``: this (request id, index) was labelled already (in the window or earlier
  in the same body): counted once;
* ``bad_index``: the request had fewer instances than ``index``.

None of these is an error (feedback arrives late and from elsewhere); a body that breaks
the schema is a 400 naming the field.

Memory is bounded: the index remembers ``index_entries`` request ids (~160 bytes each,
measured; it never holds more, even while a restart reads a full log),
each window holds at most ``window_pairs`` labelled predictions (21 bytes each in numpy
arrays), for at most ``max_series`` (version, arm) pairs.

In Kubernetes each pod knows only its own predictions: post a label to the pod that
answered (its sidecar, e.g. through a headless Service) or to every pod (the others count
it ``unknown``); sum ``joined`` over pods. docs/observability.md explains both.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Self

import numpy as np
import orjson
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serve.common.quality import ScoreSummary, logloss, summarize
from serve.metrics import (
    BASELINE_AUC,
    BASELINE_CALIBRATION_RATIO,
    BASELINE_OBSERVED_CTR,
    BASELINE_PREDICTED_CTR,
    FEEDBACK_LABELS_TOTAL,
    FEEDBACK_RESULTS,
    ONLINE_AUC,
    ONLINE_CALIBRATION_RATIO,
    ONLINE_CLICKS_TOTAL,
    ONLINE_LABELS,
    ONLINE_LOGLOSS_NATS_TOTAL,
    ONLINE_LOGLOSS_SQ_NATS2_TOTAL,
    ONLINE_OBSERVED_CTR,
    ONLINE_PREDICTED_CTR,
    ONLINE_ROWS_TOTAL,
    ONLINE_SCORE_TOTAL,
    PREDICTION_LOG_BYTES,
)
from serve.sidecar.config import FeedbackConfig
from serve.store.predlog import RecordReader, log_files, read_at

__all__ = [
    "CalibrationWindow",
    "FeedbackResult",
    "FeedbackService",
    "PredictionIndex",
    "QualityTotals",
    "label_keys",
]

_log = logging.getLogger(__name__)


def label_keys(request_ids: Sequence[str], indices: Sequence[int]) -> np.ndarray:
    """uint64 (n,) keys of (request id, index) pairs, to find duplicates with numpy."""
    out = np.empty(len(request_ids), dtype=np.uint64)
    for i, (rid, idx) in enumerate(zip(request_ids, indices, strict=True)):
        out[i] = int.from_bytes(
            hashlib.blake2b(f"{rid}#{idx}".encode(), digest_size=8).digest(), "little")
    return out


#: Bits of a packed location for the byte offset; the file's number is above them.
_OFFSET_BITS = 40
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
#: Records parsed between two trims of the index (bounds what one refresh holds beyond it).
_BATCH_RECORDS = 4096
#: Records one request id keeps at most (one per scored arm: stable, shadow candidate).
_MAX_RECORDS_PER_ID = 4


def _writers_newest(files: Sequence[Path]) -> set[str]:
    """Names of each writer's newest file (``<ms>-<pid>.dpl``): the only ones a worker may
    still append to; every older file of the same pid is closed."""
    newest: dict[str, str] = {}
    for p in files:  # oldest first: the last one per pid wins
        newest[p.stem.partition("-")[2]] = p.name
    return set(newest.values())


class PredictionIndex:
    """Request id -> where its records are in the prediction log; bounded while it is built.

    Each entry is the request id (str) -> ONE int, ``file number << 40 | byte offset`` (a
    tuple of such ints for an id logged more than once: shadow mode's two arms). Version,
    arm and scores are read from the record itself at join time. Measured: ~180 bytes per
    entry with 36-character ids (tests/test_feedback_bounded.py), so the default 200,000
    entries are ~36 MB.

    :meth:`refresh` reads what the workers appended since the last call, planned NEWEST
    first: it walks the record headers (never the scores) of the newest pending data back
    until ``max_entries`` records are found and never reads anything older; then it reads
    the request ids of those records oldest first, in batches of 4,096, trimming the
    oldest entries before each batch, so never more than ``max_entries`` are alive. The
    work of one refresh is therefore bounded by ``max_entries`` records (plus a header walk
    of the files a worker may still append to), not by the log's size: a restart over a
    full 256 MiB log reads the newest 200,000 records, not 2 million.

    Not thread-safe: one caller at a time (FeedbackService holds its join lock).
    """

    def __init__(self, directory: Path, max_entries: int) -> None:
        self.directory = directory
        self.max_entries = max_entries
        self.last_refresh_s = 0.0
        self._offsets: dict[str, int] = {}  # file name -> bytes read (complete records)
        self._numbers: dict[str, int] = {}  # live file name -> its number
        self._names: dict[int, str] = {}  # number -> live file name
        self._next_number = 0
        self._entries: dict[str, int | tuple[int, ...]] = {}  # insertion order = age
        self.size = 0  # len(_entries), readable without a lock

    def refresh(self) -> int:
        """Index what was appended since the last call; returns the records read. Files
        deleted since are forgotten (their entries then join as ``expired``)."""
        t0 = time.perf_counter()
        files = log_files(self.directory)
        self._forget_gone({p.name for p in files})
        added = sum(self._read_ids(path, start, end) for path, start, end in self._plan(files))
        self.last_refresh_s = time.perf_counter() - t0
        return added

    def _forget_gone(self, live: set[str]) -> None:
        for gone in [n for n in self._offsets if n not in live]:
            del self._offsets[gone]
            number = self._numbers.pop(gone, None)
            if number is not None:
                del self._names[number]

    def _plan(self, files: Sequence[Path]) -> list[tuple[Path, int, int]]:
        """(file, start, end) byte ranges to read, oldest first: the newest ``max_entries``
        pending records. Older pending data is marked read without reading it."""
        budget = self.max_entries
        open_files = _writers_newest(files)
        plan: list[tuple[Path, int, int]] = []
        for path in reversed(files):
            start = self._offsets.get(path.name, 0)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if size <= start:
                continue
            if budget <= 0 and path.name not in open_files:
                self._offsets[path.name] = size  # closed, and older than what is kept
                continue
            offsets, end = _record_offsets(path, start, size)
            if budget <= 0:
                self._offsets[path.name] = end
                continue
            if len(offsets) > budget:
                start = offsets[len(offsets) - budget]
            budget -= min(budget, len(offsets))
            plan.append((path, start, end))
        plan.reverse()
        return plan

    def _number(self, name: str) -> int:
        number = self._numbers.get(name)
        if number is None:
            number = self._numbers[name] = self._next_number
            self._names[number] = name
            self._next_number += 1
        return number

    def _read_ids(self, path: Path, start: int, end: int) -> int:
        """Index the records of ``path`` in [start, end); returns how many were read."""
        try:
            f = open(path, "rb")  # noqa: SIM115
        except FileNotFoundError:
            return 0
        number = self._number(path.name) << _OFFSET_BITS
        batch_max = max(1, min(_BATCH_RECORDS, self.max_entries))
        read = 0
        with f:
            reader = RecordReader(f, start, end, name=path.name)
            batch: list[tuple[bytes, int]] = []
            for offset, meta in reader:
                batch.append((meta or b"", number | offset))
                if len(batch) >= batch_max:
                    read += self._add(batch, path)
                    batch = []
            read += self._add(batch, path)
        self._offsets[path.name] = reader.end
        return read

    def _add(self, batch: list[tuple[bytes, int]], path: Path) -> int:
        """Parse a batch's request ids and add them, trimming the oldest entries first."""
        found: list[tuple[str, int]] = []
        for meta, loc in batch:
            try:
                found.append((str(orjson.loads(meta)["id"]), loc))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                _log.warning("prediction log %s: unreadable record at byte %d; skipped",
                             path, loc & _OFFSET_MASK)
        self._trim(self.max_entries - len(found))
        entries = self._entries
        for rid, loc in found:
            prev = entries.get(rid)
            if prev is None:
                entries[rid] = loc
            elif isinstance(prev, tuple):
                entries[rid] = (*prev[1 - _MAX_RECORDS_PER_ID:], loc)
            else:
                entries[rid] = (prev, loc)
        self.size = len(entries)
        return len(found)

    def _trim(self, keep: int) -> None:
        """Drop the oldest entries until at most ``keep`` are left."""
        excess = len(self._entries) - max(0, keep)
        if excess > 0:
            for rid in list(itertools.islice(self._entries, excess)):
                del self._entries[rid]
            self.size = len(self._entries)

    def lookup(self, request_id: str) -> list[tuple[str | None, int]]:
        """Where the records of ``request_id`` are (one per scored arm): (file name, byte
        offset), the name None when the file has been deleted since; [] when unknown."""
        got = self._entries.get(request_id)
        if got is None:
            return []
        locs = got if isinstance(got, tuple) else (got,)
        return [(self._names.get(loc >> _OFFSET_BITS), loc & _OFFSET_MASK) for loc in locs]

    def __len__(self) -> int:
        return self.size


def _record_offsets(path: Path, start: int, size: int) -> tuple[array[int], int]:
    """Offsets of the complete records of ``path`` in [start, size) (headers only), and
    the offset after the last one."""
    offsets: array[int] = array("Q")
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return offsets, start
    with f:
        reader = RecordReader(f, start, size, name=path.name, meta=False)
        offsets.extend(offset for offset, _ in reader)
    return offsets, reader.end


class _Ring:
    """Fixed-capacity arrays of (join time, score, label, key), oldest first."""

    def __init__(self, capacity: int) -> None:
        self.t = np.zeros(capacity, dtype=np.float64)
        self.score = np.zeros(capacity, dtype=np.float32)
        self.label = np.zeros(capacity, dtype=np.uint8)
        self.key = np.zeros(capacity, dtype=np.uint64)
        self.start = 0  # index of the oldest
        self.size = 0

    @property
    def capacity(self) -> int:
        return int(self.t.shape[0])

    def _order(self) -> np.ndarray:
        return (self.start + np.arange(self.size)) % self.capacity

    def add(self, t: float, score: np.ndarray, label: np.ndarray, key: np.ndarray) -> None:
        n = score.shape[0]
        cap = self.capacity
        if n >= cap:  # only the newest fit
            score, label, key = score[-cap:], label[-cap:], key[-cap:]
            n = cap
        pos = (self.start + self.size + np.arange(n)) % cap
        self.t[pos], self.score[pos], self.label[pos], self.key[pos] = t, score, label, key
        overflow = max(0, self.size + n - cap)
        self.start = (self.start + overflow) % cap
        self.size = min(cap, self.size + n)

    def expire(self, before: float) -> bool:
        """Drop entries that joined before ``before``; True when any went."""
        if self.size == 0:
            return False
        order = self._order()
        old = int(np.searchsorted(self.t[order], before, side="left"))
        if old:
            self.start = (self.start + old) % self.capacity
            self.size -= old
        return old > 0

    def keys(self) -> np.ndarray:
        return self.key[self._order()]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        order = self._order()
        return self.label[order], self.score[order]


class CalibrationWindow:
    """Labelled predictions per (version, arm) over the last ``window_s`` seconds.

    Args:
        window_s: seconds an entry stays (from when it was added).
        capacity: entries per (version, arm) at most (the oldest go first).
        max_series: (version, arm) pairs kept; the least recently added-to goes first.
        clock: unix seconds.
    """

    def __init__(self, window_s: float, capacity: int, max_series: int = 8,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_s, self.capacity, self.max_series = window_s, capacity, max_series
        self._clock = clock
        self._rings: dict[tuple[str, str], _Ring] = {}
        self._cache: dict[tuple[str, str], ScoreSummary | None] | None = None

    def duplicates(self, series: tuple[str, str], keys: np.ndarray) -> np.ndarray:
        """bool (n,): which ``keys`` are already in the window or repeat an earlier key."""
        ring = self._rings.get(series)
        dup = np.zeros(keys.shape[0], dtype=bool)
        _, first = np.unique(keys, return_index=True)
        dup[np.setdiff1d(np.arange(keys.shape[0]), first)] = True
        if ring is not None and ring.size:
            dup |= np.isin(keys, ring.keys())
        return dup

    def add(self, series: tuple[str, str], scores: np.ndarray, labels: np.ndarray,
            keys: np.ndarray) -> None:
        """Add labelled predictions (float32 scores, 0/1 labels, uint64 keys, all (n,))."""
        ring = self._rings.pop(series, None)  # re-inserted last: most recently used
        if ring is None:
            ring = _Ring(self.capacity)
            while len(self._rings) >= self.max_series:
                del self._rings[next(iter(self._rings))]
        self._rings[series] = ring
        ring.add(self._clock(), np.asarray(scores, dtype=np.float32),
                 np.asarray(labels, dtype=np.uint8), np.asarray(keys, dtype=np.uint64))
        self._cache = None

    def summaries(self) -> dict[tuple[str, str], ScoreSummary | None]:
        """Per (version, arm): the window's :class:`ScoreSummary` (None when empty)."""
        before = self._clock() - self.window_s
        expired = [ring.expire(before) for ring in self._rings.values()]
        if self._cache is None or any(expired):
            out: dict[tuple[str, str], ScoreSummary | None] = {}
            for series, ring in self._rings.items():
                labels, scores = ring.arrays()
                out[series] = summarize(labels, scores) if labels.shape[0] else None
            self._cache = out
        return dict(self._cache)


class QualityTotals:
    """Per (version, arm): the additive sums of every label joined since this was made.

    For each series: ``rows`` (labels), ``clicks`` (sum of labels), ``score`` (sum of the
    predicted probabilities), ``logloss`` (sum of log losses, nats,
    :func:`serve.common.quality.logloss`) and ``logloss_sq`` (sum of their squares,
    nats^2). Monotonic (counters) while a series is kept; at most ``max_series`` are kept,
    the least recently added-to goes first (a reader sees its counters reset).

    Labels are added once: a duplicate (request id, index) is found in the window, so one
    posted again after its first posting left the window (``window_s``) counts again.

    Not thread-safe: FeedbackService updates and reads it under its stats lock.
    """

    FIELDS: tuple[str, ...] = ("rows", "clicks", "score", "logloss", "logloss_sq")

    def __init__(self, max_series: int = 8) -> None:
        self.max_series = max_series
        self._sums: dict[tuple[str, str], np.ndarray] = {}

    def add(self, series: tuple[str, str], scores: np.ndarray, labels: np.ndarray) -> None:
        """Add labelled predictions: float (n,) scores in [0, 1], 0/1 (n,) labels."""
        sums = self._sums.pop(series, None)  # re-inserted last: most recently used
        if sums is None:
            sums = np.zeros(len(self.FIELDS), dtype=np.float64)
            while len(self._sums) >= self.max_series:
                del self._sums[next(iter(self._sums))]
        self._sums[series] = sums
        y = np.asarray(labels, dtype=np.float64).reshape(-1)
        p = np.asarray(scores, dtype=np.float64).reshape(-1)
        ll = logloss(y, p)
        sums += (y.shape[0], y.sum(), p.sum(), ll.sum(), (ll * ll).sum())

    def snapshot(self) -> dict[tuple[str, str], dict[str, float]]:
        """Per series, a copy of its sums by field name."""
        return {k: dict(zip(self.FIELDS, (float(x) for x in v), strict=True))
                for k, v in self._sums.items()}


@dataclass
class FeedbackResult:
    """The answer to one POST /feedback: labels by result, and joined by arm."""

    received: int
    results: dict[str, int]
    joined_by_series: dict[tuple[str, str], int]

    def to_json(self) -> dict[str, Any]:
        return {"received": self.received, **self.results,
                "joined_by_arm": [{"version": v, "arm": a, "labels": n}
                                  for (v, a), n in sorted(self.joined_by_series.items())]}


class _OpenFiles:
    """The log files one join reads, each opened once (a body of 100,000 labels reads
    ~100,000 records from a few dozen files)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._files: dict[str, BinaryIO | None] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, name: str | None, offset: int) -> tuple[dict[str, Any], np.ndarray] | None:
        """The record at ``offset`` of file ``name``; None when the file is gone."""
        if name is None:
            return None
        if name not in self._files:
            try:
                self._files[name] = self._stack.enter_context(
                    open(self._directory / name, "rb"))  # noqa: SIM115
            except FileNotFoundError:
                self._files[name] = None
        f = self._files[name]
        return read_at(f, offset) if f is not None else None


def _finite(x: float | None) -> float:
    return math.nan if x is None else float(x)


class FeedbackService(Collector):
    """Joins labels with the prediction log; a Prometheus collector of the results.

    Args:
        config: see :class:`FeedbackConfig`.
        versions: the versions being served now (stable, candidate): their baselines are
            exported even before any feedback.
        baseline_of: a version's build-time baseline (its report's ``baseline``), None
            when the report has none (built before baselines existed) or is missing.
        clock: unix seconds.

    Two locks, so that a scrape never waits on the log: the JOIN lock serializes
    :meth:`post` (the index refresh and the file reads); the STATS lock guards only the
    windows and the counts, held for one window update or one summary. :meth:`collect`
    and :meth:`status` take the stats lock only, and read the index's size without a lock:
    ``GET /metrics`` answers while a refresh reads a full log.
    """

    def __init__(self, config: FeedbackConfig, *,
                 versions: Callable[[], Iterable[str]] = tuple,
                 baseline_of: Callable[[str], dict[str, Any] | None] = lambda v: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._versions = versions
        self._baseline_of = baseline_of
        self._join_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._index = (PredictionIndex(config.log_dir, config.index_entries)
                       if config.log_dir is not None else None)
        self.window = CalibrationWindow(config.window_s, config.window_pairs,
                                        config.max_series, clock)
        self._counts = dict.fromkeys(FEEDBACK_RESULTS, 0)
        self.totals = QualityTotals(config.max_series)

    def refresh_index(self) -> int:
        """Index what the workers appended since the last call (records read); 0 without
        a log. :meth:`post` calls it; a caller may also call it ahead (from a thread: it
        reads files) so that the first POST after a restart finds the index built."""
        if self._index is None:
            return 0
        with self._join_lock:
            return self._index.refresh()

    def post(self, labels: Sequence[tuple[str, int, int]]) -> FeedbackResult:
        """Join ``labels`` = (request id, instance index, label 0/1) triples.

        Blocking (file reads, numpy): call it from a thread in async code.
        """
        with self._join_lock:
            if self._index is not None:
                self._index.refresh()
            outcome, joined = self._join(labels)
            with self._stats_lock:
                return self._record(labels, outcome, joined)

    def _join(self, labels: Sequence[tuple[str, int, int]]
              ) -> tuple[list[str], dict[tuple[str, str], tuple[list[int], list[float]]]]:
        """Per label its outcome before the duplicate check, and per (version, arm) the
        positions of the labels joined and their scores."""
        by_rid: dict[str, list[int]] = {}
        for i, (rid, _, _) in enumerate(labels):
            by_rid.setdefault(rid, []).append(i)
        outcome: list[str] = ["unknown"] * len(labels)
        joined: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        if self._index is None:
            return outcome, joined
        with _OpenFiles(self._index.directory) as files:
            for rid, positions in by_rid.items():
                for name, offset in self._index.lookup(rid):
                    rec = files.read(name, offset)
                    if rec is None or rec[0].get("id") != rid:
                        for i in positions:
                            if outcome[i] == "unknown":
                                outcome[i] = "expired"
                        continue
                    meta, scores = rec
                    series = (str(meta.get("v")), str(meta.get("a")))
                    for i in positions:
                        idx = labels[i][1]
                        if idx >= scores.shape[0]:
                            if outcome[i] != "joined":
                                outcome[i] = "bad_index"
                            continue
                        pos, got = joined.setdefault(series, ([], []))
                        pos.append(i)
                        got.append(float(scores[idx]))
                        outcome[i] = "joined"
        return outcome, joined

    def _record(self, labels: Sequence[tuple[str, int, int]], outcome: list[str],
                joined: dict[tuple[str, str], tuple[list[int], list[float]]]
                ) -> FeedbackResult:
        """Add the joined labels to the windows (all but duplicates) and count outcomes;
        under the stats lock."""
        results = dict.fromkeys(FEEDBACK_RESULTS, 0)
        added: dict[tuple[str, str], int] = {}
        dup_any = np.zeros(len(labels), dtype=bool)
        new_any = np.zeros(len(labels), dtype=bool)
        for series, (pos, scores) in joined.items():
            p = np.asarray(pos)
            keys = label_keys([labels[i][0] for i in pos], [labels[i][1] for i in pos])
            dup = self.window.duplicates(series, keys)
            dup_any[p[dup]] = True
            new_any[p[~dup]] = True
            keep = ~dup
            if keep.any():
                kept_scores = np.asarray(scores, dtype=np.float32)[keep]
                kept_labels = np.asarray([labels[i][2] for i in pos], dtype=np.uint8)[keep]
                self.window.add(series, kept_scores, kept_labels, keys[keep])
                self.totals.add(series, kept_scores, kept_labels)
                added[series] = int(keep.sum())
        for i, o in enumerate(outcome):
            if o == "joined" and dup_any[i] and not new_any[i]:
                o = "duplicate"
            results[o] += 1
        for k, v in results.items():
            self._counts[k] += v
        return FeedbackResult(len(labels), results, added)

    # ------------------------------------------------------------------ status, metrics

    def _baselines(self, extra: Iterable[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for v in sorted({*self._versions(), *extra}):
            try:
                b = self._baseline_of(v)
            except Exception:  # noqa: BLE001 - a missing or unreadable report: no baseline
                _log.debug("no baseline for version %s", v, exc_info=True)
                b = None
            if b:
                out[v] = b
        return out

    def status(self) -> dict[str, Any]:
        """GET /feedback: bounds, counts, and per (version, arm) the window with the
        version's baseline beside it."""
        with self._stats_lock:
            summaries = self.window.summaries()
            counts = dict(self._counts)
        indexed = self._index.size if self._index is not None else 0
        baselines = self._baselines(v for v, _ in summaries)
        c = self.config
        return {
            "prediction_log": {"dir": str(c.log_dir) if c.log_dir else None,
                               "bytes": self._log_bytes(), "indexed_requests": indexed,
                               "index_entries": c.index_entries},
            "window_s": c.window_s, "window_pairs": c.window_pairs,
            "labels": counts,
            "arms": [{"version": v, "arm": a,
                      "online": {k: x for k, x in s.to_dict().items()
                                 if not k.startswith("score_")} if s is not None else None,
                      "baseline": _baseline_view(baselines.get(v))}
                     for (v, a), s in sorted(summaries.items())],
            "baselines": {v: _baseline_view(b) for v, b in baselines.items()},
        }

    def quality_collect(self) -> Iterator[Metric]:
        """Only the label sums' counter families (``dlrm_online_rows_total`` ...), what
        the rollout's click-quality gates read (:func:`~serve.sidecar.control.
        quality_gates.quality_snapshot`): no baselines, no file reads, the stats lock
        only."""
        with self._stats_lock:
            totals = self.totals.snapshot()
        yield from _quality_families(totals)

    def _log_bytes(self) -> int:
        if self.config.log_dir is None:
            return 0
        total = 0
        for p in log_files(self.config.log_dir):
            try:
                total += p.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def collect(self) -> Iterator[Metric]:
        with self._stats_lock:
            summaries = self.window.summaries()
            counts = dict(self._counts)
            totals = self.totals.snapshot()
        c = CounterMetricFamily(FEEDBACK_LABELS_TOTAL,
                                "Click labels posted to /feedback, by what became of them.",
                                labels=["result"])
        for r in FEEDBACK_RESULTS:
            c.add_metric([r], counts[r])
        yield c
        families = {
            ONLINE_LABELS: ("Labelled predictions in the feedback window.", "rows"),
            ONLINE_OBSERVED_CTR: ("Observed CTR (mean label) over the feedback window.",
                                  "observed_ctr"),
            ONLINE_PREDICTED_CTR: (("Mean predicted CTR of the labelled predictions in the "
                                   "feedback window."), "predicted_ctr"),
            ONLINE_CALIBRATION_RATIO: (("Mean predicted CTR / observed CTR over the feedback "
                                       "window (1 = calibrated; NaN without clicks)."),
                                       "calibration_ratio"),
            ONLINE_AUC: (("ROC AUC of the labelled predictions in the feedback window "
                         "(NaN with one class only)."), "auc"),
        }
        for name, (doc, attr) in families.items():
            g = GaugeMetricFamily(name, doc, labels=["version", "arm"])
            for (v, a), s in sorted(summaries.items()):
                if s is None:
                    continue
                g.add_metric([v, a], _finite(getattr(s, attr)))
            yield g
        yield from _quality_families(totals)
        baselines = self._baselines(v for v, _ in summaries)
        for name, key, doc in (
                (BASELINE_PREDICTED_CTR, "predicted_ctr",
                 "Mean predicted CTR on held-out data at build time (the version's report)."),
                (BASELINE_OBSERVED_CTR, "observed_ctr",
                 "Observed CTR of the held-out data at build time."),
                (BASELINE_CALIBRATION_RATIO, "calibration_ratio",
                 "Calibration ratio (predicted / observed CTR) on held-out data at build time."),
                (BASELINE_AUC, "auc", "ROC AUC on held-out data at build time.")):
            g = GaugeMetricFamily(name, doc, labels=["version"])
            for v, b in baselines.items():
                g.add_metric([v], _finite(b.get(key)))
            yield g
        yield GaugeMetricFamily(PREDICTION_LOG_BYTES,
                                "Bytes of prediction log files kept for joining feedback.",
                                value=self._log_bytes())


def _quality_families(totals: dict[tuple[str, str], dict[str, float]]) -> Iterator[Metric]:
    for name, key, doc in (
            (ONLINE_ROWS_TOTAL, "rows", ("Labelled predictions joined since the sidecar "
             "started (the click-quality gates' n).")),
            (ONLINE_CLICKS_TOTAL, "clicks", "Clicks (label 1) among them."),
            (ONLINE_SCORE_TOTAL, "score", "Sum of their predicted click probabilities."),
            (ONLINE_LOGLOSS_NATS_TOTAL, "logloss", ("Sum of their log losses, in nats "
             "(score clipped to [1e-7, 1-1e-7]).")),
            (ONLINE_LOGLOSS_SQ_NATS2_TOTAL, "logloss_sq",
             "Sum of the squares of their log losses, in nats^2 (for its variance).")):
        fam = CounterMetricFamily(name, doc, labels=["version", "arm"])
        for (v, a), t in sorted(totals.items()):
            fam.add_metric([v, a], t[key])
        yield fam


def _baseline_view(b: dict[str, Any] | None) -> dict[str, Any] | None:
    if b is None:
        return None
    return {k: b.get(k) for k in ("rows", "observed_ctr", "predicted_ctr",
                                  "calibration_ratio", "auc")}
