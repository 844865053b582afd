"""Held-out click logs through the HTTP API: score a split of a version's data on a live
endpoint and keep, per request, what a feedback job needs (request id, arm, scores).

Used by ``python -m serve.ops.feedback_check`` (online calibration against the build's
baseline); any job that wants to measure a deployed model on the same rows as the build
can use :func:`score_split` too.

Shapes: B instances per request, F = 26 sparse features, N = 13 dense features.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from serve.api.binary import encode_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.errors import ConfigError, UpstreamUnavailable

__all__ = ["ScoredRequest", "binary_bodies", "score_split"]


@dataclass(frozen=True)
class ScoredRequest:
    """One answered request: rows ``[start, stop)`` of the split, TorchServe's request id
    (``x-request-id``), the answering version and arm, and float32 (B,) scores."""

    start: int
    stop: int
    request_id: str
    version: str | None
    arm: str | None
    scores: np.ndarray


def binary_bodies(data_dir: str | os.PathLike, split: str = "eval", rows: int | None = None,
                  batch: int = 512) -> Iterator[tuple[int, int, bytes]]:
    """(start, stop, binary columnar body) for consecutive ``batch``-row slices of a split.

    Raises:
        ConfigError: no data there (names the folder and how to make it).
    """
    from serve.model.data import columnar_rows, load_split  # the offline data format; not pod code

    if batch < 1:
        raise ConfigError(f"batch={batch} must be >= 1 (instances per request)")
    data = load_split(data_dir, split)
    n = len(data) if rows is None else min(rows, len(data))
    for start in range(0, n, batch):
        stop = min(start + batch, n)
        dense, values, lengths = columnar_rows(data, start, stop)
        yield start, stop, encode_binary(dense, lengths, values)


def score_split(url: str, data_dir: str | os.PathLike, split: str = "eval",
                rows: int | None = None, batch: int = 512, clients: int = 4,
                timeout_s: float = 60.0,
                progress: Callable[[int, int], None] | None = None) -> list[ScoredRequest]:
    """Send the split's rows to ``url`` (``.../predictions/<model>``), ``clients`` at a time.

    Returns the answers in row order. Raises UpstreamUnavailable on any non-200 answer
    (naming the status and body): a check over partial data would mislead.
    """
    bodies = list(binary_bodies(data_dir, split, rows, batch))
    total = bodies[-1][1] if bodies else 0

    def send(client: httpx.Client, item: tuple[int, int, bytes]) -> ScoredRequest:
        start, stop, body = item
        r = client.post(url, content=body, headers={"Content-Type": BINARY_MEDIA_TYPE})
        if r.status_code != 200:
            raise UpstreamUnavailable(f"POST {url} rows {start}..{stop} answered "
                                      f"{r.status_code}: {r.text[:300]}")
        scores = np.asarray(r.json()["predictions"], dtype=np.float32)
        if scores.shape[0] != stop - start:
            raise UpstreamUnavailable(f"POST {url} rows {start}..{stop}: {scores.shape[0]} "
                                      f"predictions for {stop - start} instances")
        return ScoredRequest(start, stop, r.headers.get("x-request-id", ""),
                             r.headers.get("X-DLRM-Model-Version"),
                             r.headers.get("X-DLRM-Arm"), scores)

    out: list[ScoredRequest] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with httpx.Client(timeout=timeout_s, limits=limits, trust_env=False) as client, \
            cf.ThreadPoolExecutor(max_workers=clients) as pool:
        for res in pool.map(lambda it: send(client, it), bodies):
            out.append(res)
            if progress is not None:
                progress(res.stop, total)
    return out


def data_dir_of(report: dict, repo_root: Path) -> Path:
    """The data folder a version was built from (its report's ``build_dir``/data)."""
    build_dir = report.get("build_dir")
    if not build_dir:
        raise ConfigError(f"the report of version {report.get('version')!r} names no "
                          "build_dir; pass --data-dir")
    p = Path(build_dir)
    return (p if p.is_absolute() else repo_root / p) / "data"
