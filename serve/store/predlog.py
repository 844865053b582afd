"""The prediction log: a bounded, sampled record of what the pod answered, in files.

Click feedback arrives minutes after a prediction (``POST /feedback`` on the sidecar,
:mod:`serve.sidecar.services.feedback`); to join a label with the score the model gave, the pod
keeps its answers for a while. TorchServe workers APPEND records here; the sidecar reads
them. Both only need a shared folder (an ``emptyDir`` in the pod), never shared memory.

Bounds (documented in docs/observability.md and docs/configuration.md), all settable through the
environment of TorchServe (variables in :mod:`serve.settings`, defaults in the fields of
:class:`PredictionLogConfig`):

* ``DLRM_PREDICTION_LOG_DIR``: the folder; unset or empty = no log (feedback then joins
  nothing and counts every label ``unknown``).
* ``DLRM_PREDICTION_LOG_SAMPLE`` (default 1.0): share of requests logged, chosen by a hash
  of the request id, so every worker and the sidecar agree on which ids are in.
* ``DLRM_PREDICTION_LOG_FILE_BYTES`` (default 8 MiB): a worker starts a new file past it.
* ``DLRM_PREDICTION_LOG_MAX_BYTES`` (default 256 MiB): the whole folder's bound; whenever a
  worker starts a file, the oldest files (any worker's) are deleted until the folder fits.
  A prediction is kept until its file is deleted: at 50,000 instances/s (200 KB/s of
  float32 scores) 256 MiB hold ~20 minutes; lower the sample rate for longer delays.

Files are ``<unix ms>-<pid>.dpl`` (names sort by age). A record::

    b"DPL1" | uint32 meta_bytes | uint32 n | meta (UTF-8 JSON) | float32 scores[n]

little-endian, ``meta = {"id": request id, "v": version, "a": arm, "t": unix seconds}``
and ``scores`` the request's probabilities in instance order. A worker writes one batch's
records with ONE ``write`` on an unbuffered file; a reader that meets a partial record
(the write still under way) stops there and resumes from the same offset later.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import orjson

from serve.common.filemodes import private_dir, private_opener
from serve.common.flags import flag
from serve.common.validate import int_at_least, number_in_range
from serve.errors import ConfigError
from serve.settings import (
    DLRM_PREDICTION_LOG_DIR,
    DLRM_PREDICTION_LOG_FILE_BYTES,
    DLRM_PREDICTION_LOG_MAX_BYTES,
    DLRM_PREDICTION_LOG_SAMPLE,
)

__all__ = [
    "MAGIC",
    "SUFFIX",
    "LoggedRequest",
    "Prediction",
    "PredictionLogConfig",
    "PredictionLogWriter",
    "RecordReader",
    "encode",
    "iter_log",
    "log_files",
    "read_at",
    "read_prediction",
    "sampled",
    "scan",
]

_log = logging.getLogger(__name__)

MAGIC = b"DPL1"
SUFFIX = ".dpl"
_HEAD = struct.Struct("<4sII")
_F32 = np.dtype("<f4")
_MAX_META = 64 * 1024
_MAX_SCORES = 1 << 24
#: Bytes a :class:`RecordReader` reads at a time (more only for one record's meta).
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class PredictionLogConfig:
    """Where the log lives and its bounds (see the module docstring).

    Attributes:
        directory: the folder shared by the workers and the sidecar.
        sample_rate: share of requests logged, in [0, 1].
        file_bytes: a worker starts a new file once its file is this big (bytes).
        max_bytes: the folder's bound in bytes (>= 2 x file_bytes).
    """

    directory: Path = field(metadata=flag(env=DLRM_PREDICTION_LOG_DIR,
                                          help="the folder; unset: no log"))
    sample_rate: float = field(default=1.0, metadata=flag(
        env=DLRM_PREDICTION_LOG_SAMPLE, help="share of requests logged, in [0, 1]"))
    file_bytes: int = field(default=8 * 1024 * 1024, metadata=flag(
        env=DLRM_PREDICTION_LOG_FILE_BYTES, help="a worker starts a new file past it"))
    max_bytes: int = field(default=256 * 1024 * 1024, metadata=flag(
        env=DLRM_PREDICTION_LOG_MAX_BYTES, help="the folder's bound"))

    def __post_init__(self) -> None:
        number_in_range(DLRM_PREDICTION_LOG_SAMPLE.name, self.sample_rate, 0, 1,
                        then=" (the share of requests logged for feedback)")
        for var, v in ((DLRM_PREDICTION_LOG_FILE_BYTES, self.file_bytes),
                       (DLRM_PREDICTION_LOG_MAX_BYTES, self.max_bytes)):
            int_at_least(var.name, v, 4096, then=" (bytes)")
        if self.max_bytes < 2 * self.file_bytes:
            raise ConfigError(f"{DLRM_PREDICTION_LOG_MAX_BYTES}={self.max_bytes} must be at "
                              f"least twice {DLRM_PREDICTION_LOG_FILE_BYTES}={self.file_bytes}: "
                              "the folder keeps the file being written plus at least one full "
                              "one")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PredictionLogConfig | None:
        """The config from ``DLRM_PREDICTION_LOG_*``; None when the folder is not set.

        Raises:
            ConfigError: a value that is not a number or breaks a rule.
        """
        directory = DLRM_PREDICTION_LOG_DIR.get(env)
        if directory is None:
            return None
        read: dict[str, float | int | None] = {
            "sample_rate": DLRM_PREDICTION_LOG_SAMPLE.get_float(env),
            "file_bytes": DLRM_PREDICTION_LOG_FILE_BYTES.get_int(env),
            "max_bytes": DLRM_PREDICTION_LOG_MAX_BYTES.get_int(env)}
        kwargs = {name: v for name, v in read.items() if v is not None}
        return cls(Path(directory), **kwargs)  # type: ignore[arg-type]


def sampled(request_id: str, rate: float) -> bool:
    """Whether ``request_id`` is in the sampled share ``rate``: a hash, so deterministic."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return h / 2.0**64 < rate


@dataclass(frozen=True)
class Prediction:
    """One request's answer: ``scores`` float32 (n,) probabilities in instance order."""

    request_id: str
    version: str
    arm: str
    t: float
    scores: np.ndarray


@dataclass(frozen=True)
class LoggedRequest:
    """Where a logged request's record is: file name (in the folder), byte offset, and
    its version, arm and number of instances (read without its scores)."""

    file: str
    offset: int
    request_id: str
    version: str
    arm: str
    t: float
    n: int


def encode(p: Prediction) -> bytes:
    """One record (see the module docstring). Called per request on the worker's hot path:
    orjson and no array copy for the usual float32 (n,) scores (~2.5 us instead of ~8)."""
    meta = orjson.dumps({"id": p.request_id, "v": p.version, "a": p.arm, "t": round(p.t, 3)})
    scores = p.scores
    if scores.dtype != _F32 or scores.ndim != 1 or not scores.flags.c_contiguous:
        scores = np.ascontiguousarray(scores, dtype=_F32).reshape(-1)
    return _HEAD.pack(MAGIC, len(meta), scores.shape[0]) + meta + scores.tobytes()


def log_files(directory: Path) -> list[Path]:
    """The folder's log files, oldest first (names start with their unix ms)."""
    try:
        return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))
    except FileNotFoundError:
        return []


class PredictionLogWriter:
    """A worker's appender. Not thread-safe: one per worker, called from ``handle``.

    Args:
        config: the folder and bounds.
        pid: names this worker's files (default ``os.getpid()``).
        clock: unix seconds, for file names and record times.

    Errors writing (disk full, folder gone) are logged once per file and drop the
    records: the log must never fail a prediction.
    """

    def __init__(self, config: PredictionLogConfig, pid: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._pid = os.getpid() if pid is None else pid
        self._clock = clock
        self._file: BinaryIO | None = None
        self._size = 0
        self._failed = False
        private_dir(config.directory)  # request ids and scores: this user's only

    def write(self, predictions: Iterable[Prediction]) -> int:
        """Append the sampled ones among ``predictions`` in one write; returns how many."""
        rate = self.config.sample_rate
        chunks = [encode(p) for p in predictions if sampled(p.request_id, rate)]
        if not chunks:
            return 0
        data = b"".join(chunks)
        try:
            f = self._file
            if f is None or self._size >= self.config.file_bytes:
                f = self._rotate()
            f.write(data)
            self._size += len(data)
            self._failed = False
        except OSError as e:
            if not self._failed:
                _log.warning("prediction log: writing %d bytes to %s failed (%s); these "
                             "predictions cannot be joined with feedback", len(data),
                             self.config.directory, e)
            self._failed = True
            self.close()
            return 0
        return len(chunks)

    def _rotate(self) -> BinaryIO:
        """Start this worker's next file (and prune the folder); returns it."""
        self.close()
        name = f"{int(self._clock() * 1000):013d}-{self._pid}{SUFFIX}"
        f = open(self.config.directory / name, "ab", buffering=0,  # noqa: SIM115
                 opener=private_opener)
        self._file, self._size = f, 0
        self._prune(current=name)
        return f

    def _prune(self, current: str) -> None:
        """Delete the oldest files until the folder fits ``max_bytes`` (never ``current``)."""
        sizes: list[tuple[Path, int]] = []
        for p in log_files(self.config.directory):
            try:
                sizes.append((p, p.stat().st_size))
            except FileNotFoundError:  # another worker pruned it
                continue
        total = sum(s for _, s in sizes)
        for p, s in sizes:
            if total <= self.config.max_bytes - self.config.file_bytes:
                break
            if p.name == current:
                continue
            with contextlib.suppress(FileNotFoundError):  # another worker pruned it
                p.unlink()
            total -= s

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def scan(path: Path, offset: int) -> tuple[list[LoggedRequest], int]:
    """Records of ``path`` from byte ``offset`` on, without their scores.

    Returns (records, next offset): the offset after the last COMPLETE record, where the
    next scan resumes. A corrupt record (wrong magic, absurd sizes) ends the scan at the
    file's end (logged): the rest of that file is skipped, never misread.
    """
    found: list[LoggedRequest] = []
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return found, offset
    with f:
        end = os.fstat(f.fileno()).st_size
        pos = offset
        f.seek(pos)
        while pos + _HEAD.size <= end:
            head = f.read(_HEAD.size)
            magic, meta_len, n = _HEAD.unpack(head)
            if magic != MAGIC or meta_len > _MAX_META or n > _MAX_SCORES:
                _log.warning("prediction log %s: corrupt record at byte %d; skipping the "
                             "rest of the file", path, pos)
                return found, end
            rec_end = pos + _HEAD.size + meta_len + 4 * n
            if rec_end > end:
                break  # a record still being written
            try:
                meta = json.loads(f.read(meta_len))
                found.append(LoggedRequest(path.name, pos, str(meta["id"]), str(meta["v"]),
                                           str(meta["a"]), float(meta["t"]), int(n)))
            except (ValueError, KeyError, TypeError):
                _log.warning("prediction log %s: unreadable record at byte %d; skipped",
                             path, pos)
            f.seek(rec_end)
            pos = rec_end
    return found, pos


def read_prediction(directory: Path, rec: LoggedRequest) -> Prediction | None:
    """The scores of a scanned record; None when its file was deleted meanwhile."""
    try:
        with open(directory / rec.file, "rb") as f:
            f.seek(rec.offset)
            magic, meta_len, n = _HEAD.unpack(f.read(_HEAD.size))
            f.seek(meta_len, os.SEEK_CUR)
            raw = f.read(4 * n)
    except (FileNotFoundError, struct.error):
        return None
    if magic != MAGIC or len(raw) != 4 * n:
        return None
    return Prediction(rec.request_id, rec.version, rec.arm, rec.t,
                      np.frombuffer(raw, dtype="<f4"))


class RecordReader:
    """The records of an open log file from byte ``start`` to ``size``, read in bounded
    chunks: ``(offset, meta bytes)`` per complete record (meta None when ``meta=False``:
    a walk over the headers only, never reading the scores).

    After iteration, :attr:`end` is the offset after the last complete record (where the
    next read resumes); a corrupt record sets it to ``size`` (the rest of the file is
    skipped, logged once), as :func:`scan` does. Memory: one buffer of ``chunk`` bytes
    (more only for a record whose meta alone is bigger), whatever the file's size.

    Example::

        with open(path, "rb") as f:
            reader = RecordReader(f, 0, os.fstat(f.fileno()).st_size, name=path.name)
            ids = [orjson.loads(meta)["id"] for _, meta in reader]
    """

    def __init__(self, f: BinaryIO, start: int, size: int, *, name: str = "",
                 meta: bool = True, chunk: int = _READ_BYTES) -> None:
        self._f, self._size, self._name, self._meta, self._chunk = f, size, name, meta, chunk
        self.start = start
        self.end = start

    def _fill(self, pos: int, want: int) -> bytes:
        self._f.seek(pos)
        return self._f.read(min(max(self._chunk, want), self._size - pos))

    def __iter__(self) -> Iterator[tuple[int, bytes | None]]:
        size, head = self._size, _HEAD.size
        pos = self.end = self.start
        buf, base = b"", pos  # buf holds the file's bytes from offset base on
        while pos + head <= size:
            i = pos - base
            if i + head > len(buf):
                buf, base, i = self._fill(pos, head), pos, 0
            magic, meta_len, n = _HEAD.unpack_from(buf, i)
            if magic != MAGIC or meta_len > _MAX_META or n > _MAX_SCORES:
                _log.warning("prediction log %s: corrupt record at byte %d; skipping the "
                             "rest of the file", self._name, pos)
                self.end = size
                return
            rec_end = pos + head + meta_len + 4 * n
            if rec_end > size:
                return  # a record still being written: resume here next time
            meta: bytes | None = None
            if self._meta:
                if i + head + meta_len > len(buf):
                    buf, base, i = self._fill(pos, head + meta_len), pos, 0
                meta = buf[i + head:i + head + meta_len]
            yield pos, meta
            pos = self.end = rec_end


def read_at(f: BinaryIO, offset: int) -> tuple[dict[str, Any], np.ndarray] | None:
    """The record at ``offset`` of an open log file: (meta, float32 scores (n,)); None when
    it is not a whole, readable record (the file was replaced or truncated)."""
    try:
        f.seek(offset)
        magic, meta_len, n = _HEAD.unpack(f.read(_HEAD.size))
        if magic != MAGIC or meta_len > _MAX_META or n > _MAX_SCORES:
            return None
        meta = orjson.loads(f.read(meta_len))
        raw = f.read(4 * n)
    except (OSError, struct.error, orjson.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or len(raw) != 4 * n:
        return None
    return meta, np.frombuffer(raw, dtype=_F32)


def iter_log(directory: Path) -> Iterator[Prediction]:
    """Every complete record of the folder, oldest file first (tests, debugging)."""
    for path in log_files(directory):
        recs, _ = scan(path, 0)
        for rec in recs:
            p = read_prediction(directory, rec)
            if p is not None:
                yield p
