"""Stopping what a tool started when the tool itself is stopped or fails: for the tools
that start a service of their own (``make faults``, the benchmarks).

Python's default SIGTERM ends the process at once: no ``finally`` runs, and the
TorchServe and sidecar it started (each in its own process group, so a signal to the
tool's group does not reach them) keep running and keep their ports. Inside
:func:`sigterm_unwinds` a SIGTERM raises ``SystemExit(143)`` instead, so every
``try/finally`` and context manager on the way out stops what it started.

:func:`stop_launcher` stops a ``python -m serve.ops.launcher run`` a tool started, and
the process groups the launcher recorded, whatever state it is in.
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serve.ops.process_groups import group_alive, stop_group

__all__ = ["launcher_groups", "sigterm_unwinds", "stop_launcher"]

#: ``128 + SIGTERM``: the exit status a shell reports for a process ended by SIGTERM.
SIGTERM_EXIT = 128 + signal.SIGTERM


def _unwind(signum: int, _frame: Any) -> None:
    sys.exit(SIGTERM_EXIT)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit(143)`` (it unwinds like an exception);
    the previous handler is restored on exit. Only in the main thread (where Python
    delivers signals); elsewhere a no-op."""
    try:
        previous = signal.signal(signal.SIGTERM, _unwind)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def launcher_groups(run_dir: Path) -> list[int]:
    """The process groups a launcher recorded in ``run_dir/pids.json`` (TorchServe, the
    sidecar); [] when it recorded none (yet) or the file is unreadable."""
    try:
        pids = json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(pids, dict):
        return []
    return [int(p) for p in pids.values() if isinstance(p, int) and p > 0]


def stop_launcher(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 30.0) -> None:
    """Stop a launcher (``python -m serve.ops.launcher run --run-dir run_dir``, started
    in its own session) and everything it started.

    SIGTERM first: the launcher stops its TorchServe and sidecar itself (a second
    SIGTERM skips its drain). What is left after ``timeout_s`` is killed: the
    launcher's group, then each group it recorded in ``run_dir/pids.json``, so a
    launcher killed while starting leaves no TorchServe or sidecar behind.
    """
    if proc.poll() is None:
        stop_group(proc.pid, proc, timeout_s=timeout_s)
    for pgid in launcher_groups(run_dir):
        if group_alive(pgid):
            stop_group(pgid, None, timeout_s=10.0)
