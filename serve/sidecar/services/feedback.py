"""Click feedback joined with the pod's own predictions: online CTR, calibration and AUC.

``POST /feedback`` takes labels for earlier predictions, ``{"labels": [{"request_id",
"index", "label"}]}`` (the request id is the ``x-request-id`` TorchServe put on the
prediction's response, the index the instance's position in that request). The sidecar
joins each label with the score the model gave, read from the prediction log that the
workers write (:mod:`serve.store.predlog`), and keeps the labelled predictions per version and
arm in a sliding window (:class:`CalibrationWindow`). From the window it exports the
observed CTR, the mean predicted CTR, their ratio (the calibration ratio, 1.0 = calibrated)
and the AUC, beside the version's build-time baseline from its report.

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

Memory is bounded: the index remembers ``index_entries`` request ids (~150 bytes each),
each window holds at most ``window_pairs`` labelled predictions (21 bytes each in numpy
arrays), for at most ``max_series`` (version, arm) pairs.

In Kubernetes each pod knows only its own predictions: post a label to the pod that
answered (its sidecar, e.g. through a headless Service) or to every pod (the others count
it ``unknown``); sum ``joined`` over pods. The README explains both.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serve import settings
from serve.common.flags import flag
from serve.common.quality import ScoreSummary, summarize
from serve.common.validate import positive_int
from serve.errors import ConfigError
from serve.metrics import (
    BASELINE_AUC,
    BASELINE_CALIBRATION_RATIO,
    BASELINE_OBSERVED_CTR,
    BASELINE_PREDICTED_CTR,
    FEEDBACK_LABELS_TOTAL,
    FEEDBACK_RESULTS,
    ONLINE_AUC,
    ONLINE_CALIBRATION_RATIO,
    ONLINE_LABELS,
    ONLINE_OBSERVED_CTR,
    ONLINE_PREDICTED_CTR,
    PREDICTION_LOG_BYTES,
)
from serve.store.predlog import LoggedRequest, log_files, read_prediction, scan

__all__ = [
    "CalibrationWindow",
    "FeedbackConfig",
    "FeedbackResult",
    "FeedbackService",
    "PredictionIndex",
    "label_keys",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeedbackConfig:
    """Bounds of the join (see the module docstring).

    Attributes:
        log_dir: the prediction log folder the workers write; None: no log, every label
            is ``unknown``.
        index_entries: request ids the index remembers (the newest).
        window_s: seconds a labelled prediction stays in the window (from when its label
            arrived).
        window_pairs: labelled predictions a window keeps at most (the newest).
        max_series: (version, arm) windows kept; the least recently labelled goes first.
        max_labels: labels one POST may carry.
    """

    log_dir: Path | None = field(default=None, metadata=flag(
        "--prediction-log-dir", env=settings.DLRM_PREDICTION_LOG_DIR,
        help="the prediction log folder TorchServe's workers write; POST /feedback joins "
             "labels with it. Unset: no join (every label counts as unknown)"))
    index_entries: int = field(default=200_000, metadata=flag(
        "--feedback-index-entries", env=settings.DLRM_FEEDBACK_INDEX_ENTRIES,
        help="logged request ids the join remembers (~150 bytes each)"))
    window_s: float = field(default=3600.0, metadata=flag(
        "--feedback-window-s", env=settings.DLRM_FEEDBACK_WINDOW_S,
        help="seconds a labelled prediction counts in the online CTR, calibration and AUC"))
    window_pairs: int = 500_000
    max_series: int = 8
    max_labels: int = 100_000

    def __post_init__(self) -> None:
        for name in ("index_entries", "window_pairs", "max_series", "max_labels"):
            positive_int(f"feedback {name}", getattr(self, name))
        if not (isinstance(self.window_s, (int, float)) and self.window_s > 0):
            raise ConfigError(f"feedback window_s={self.window_s!r} must be > 0 (seconds)")


def label_keys(request_ids: Sequence[str], indices: Sequence[int]) -> np.ndarray:
    """uint64 (n,) keys of (request id, index) pairs, to find duplicates with numpy."""
    out = np.empty(len(request_ids), dtype=np.uint64)
    for i, (rid, idx) in enumerate(zip(request_ids, indices, strict=True)):
        out[i] = int.from_bytes(
            hashlib.blake2b(f"{rid}#{idx}".encode(), digest_size=8).digest(), "little")
    return out


class PredictionIndex:
    """Request id -> where its records are in the prediction log, read incrementally.

    :meth:`refresh` scans what the workers appended since the last call (headers only;
    scores are read at join time). The newest ``max_entries`` request ids are kept.
    """

    def __init__(self, directory: Path, max_entries: int) -> None:
        self.directory = directory
        self.max_entries = max_entries
        self._offsets: dict[str, int] = {}  # file name -> bytes scanned
        self._entries: dict[str, list[LoggedRequest]] = {}  # insertion order = age

    def refresh(self) -> int:
        """Scan new records; returns how many. Files deleted since are forgotten."""
        files = log_files(self.directory)
        live = {p.name for p in files}
        for gone in [n for n in self._offsets if n not in live]:
            del self._offsets[gone]
        added = 0
        for path in files:
            recs, self._offsets[path.name] = scan(path, self._offsets.get(path.name, 0))
            for rec in recs:
                self._entries.setdefault(rec.request_id, []).append(rec)
            added += len(recs)
        excess = len(self._entries) - self.max_entries
        if excess > 0:
            for rid in list(self._entries)[:excess]:
                del self._entries[rid]
        return added

    def lookup(self, request_id: str) -> list[LoggedRequest] | None:
        """The records of ``request_id`` (one per scored arm), None when unknown."""
        return self._entries.get(request_id)

    def live(self, rec: LoggedRequest) -> bool:
        """Whether the record's file still exists (as of the last refresh)."""
        return rec.file in self._offsets

    def __len__(self) -> int:
        return len(self._entries)


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
    """

    def __init__(self, config: FeedbackConfig, *,
                 versions: Callable[[], Iterable[str]] = tuple,
                 baseline_of: Callable[[str], dict[str, Any] | None] = lambda v: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._versions = versions
        self._baseline_of = baseline_of
        self._lock = threading.Lock()
        self._index = (PredictionIndex(config.log_dir, config.index_entries)
                       if config.log_dir is not None else None)
        self.window = CalibrationWindow(config.window_s, config.window_pairs,
                                        config.max_series, clock)
        self._counts = dict.fromkeys(FEEDBACK_RESULTS, 0)

    def post(self, labels: Sequence[tuple[str, int, int]]) -> FeedbackResult:
        """Join ``labels`` = (request id, instance index, label 0/1) triples.

        Blocking (file reads, numpy): call it from a thread in async code.
        """
        with self._lock:
            return self._post(labels)

    def _post(self, labels: Sequence[tuple[str, int, int]]) -> FeedbackResult:
        results = dict.fromkeys(FEEDBACK_RESULTS, 0)
        if self._index is not None:
            self._index.refresh()
        by_rid: dict[str, list[int]] = {}
        for i, (rid, _, _) in enumerate(labels):
            by_rid.setdefault(rid, []).append(i)
        outcome: list[str] = ["unknown"] * len(labels)
        # Per series: (label positions, scores) joined, before the duplicate check.
        joined: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
        for rid, positions in by_rid.items():
            recs = self._index.lookup(rid) if self._index is not None else None
            if not recs:
                continue
            for rec in recs:
                pred = (read_prediction(self._index.directory, rec)  # type: ignore[union-attr]
                        if self._index is not None and self._index.live(rec) else None)
                for i in positions:
                    idx = labels[i][1]
                    if pred is None:
                        if outcome[i] == "unknown":
                            outcome[i] = "expired"
                        continue
                    if idx >= pred.scores.shape[0]:
                        if outcome[i] != "joined":
                            outcome[i] = "bad_index"
                        continue
                    pos, scores = joined.setdefault((rec.version, rec.arm), ([], []))
                    pos.append(i)
                    scores.append(float(pred.scores[idx]))
                    outcome[i] = "joined"
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
                self.window.add(series, np.asarray(scores, dtype=np.float32)[keep],
                                np.asarray([labels[i][2] for i in pos], dtype=np.uint8)[keep],
                                keys[keep])
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
        with self._lock:
            summaries = self.window.summaries()
            counts = dict(self._counts)
            indexed = len(self._index) if self._index is not None else 0
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
        with self._lock:
            summaries = self.window.summaries()
            counts = dict(self._counts)
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


def _baseline_view(b: dict[str, Any] | None) -> dict[str, Any] | None:
    if b is None:
        return None
    return {k: b.get(k) for k in ("rows", "observed_ctr", "predicted_ctr",
                                  "calibration_ratio", "auc")}
