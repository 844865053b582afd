"""What each worker has applied: ``<delta_dir>/<version>/workers/<pid>.json``, written by
the worker (:mod:`serve.runtime.follower`) after each apply and read by the sidecar."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["WorkerStatus", "read_statuses", "write_status"]


@dataclass(frozen=True)
class WorkerStatus:
    """What one worker has applied for one version (``workers/<pid>.json``)."""

    pid: int
    version: str
    sequence: int                 # last applied (0: none)
    rows: int                     # rows written by the deltas applied so far
    apply_seconds: float          # wall time of the last apply (waiting for the batch lock excluded)
    applied_at: float             # unix seconds of the last apply
    created_at: float             # the last applied delta's created_at (0: none)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_status(folder: Path, status: WorkerStatus) -> None:
    """Replace ``folder/<pid>.json`` with ``status`` (a temporary file renamed over it)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{status.pid}.json"
    tmp = folder / f".{status.pid}.json.tmp"
    tmp.write_text(json.dumps(status.to_json()))
    os.replace(tmp, final)


def read_statuses(folder: Path, pids: Sequence[int] | None = None) -> list[WorkerStatus]:
    """The statuses in ``folder``, by file name (only ``pids`` when given); a half-written
    or foreign file is skipped, never fatal."""
    out = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            raw = json.loads((folder / name).read_text())
            st = WorkerStatus(**raw)
        except (OSError, ValueError, TypeError):
            continue  # a half-written or foreign file: skipped, never fatal
        if pids is None or st.pid in pids:
            out.append(st)
    return out
