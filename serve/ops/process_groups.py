"""Process groups: each server the launcher starts leads its own (TorchServe's Java frontend
and its Python workers share one), so stopping it leaves no orphan workers."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["group_alive", "stop_group"]


def stop_group(pid: int, proc: subprocess.Popen | None = None, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL what is left after ``timeout_s``."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    leads = pgid == pid  # else not a group we lead: only signal the process itself
    try:
        os.killpg(pgid, signal.SIGTERM) if leads else os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None and not group_alive(pid):
                return
        elif not group_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL) if leads else os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies still count for killpg; reap check via /proc where available
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        parts = stat.rsplit(")", 1)[-1].split()
        if len(parts) > 3 and parts[0] != "Z" and int(parts[2]) == pgid:
            return True
    return False
