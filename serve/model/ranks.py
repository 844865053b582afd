"""Spawning training ranks and ending them: the part :mod:`serve.model.train` and
:mod:`serve.model.fit` share.

Why: gloo can abort a rank (SIGABRT, exit -6) while its process group is torn down, when a
peer closes its sockets first ("Connection closed by peer" raised in gloo's I/O thread,
where nothing catches it). The rank's work is finished by then, yet the whole training
failed with it (seen once in CI on a 2-core machine, after the last step's output was
written). So:

* :func:`settle` — after its last collective, each rank writes ``rank<r>.done`` in the
  output directory and waits until every rank has written its own before any of them
  destroys its process group: no rank closes sockets while a peer is still inside a
  collective.
* :func:`spawn_ranks` — when a rank still dies after *every* rank wrote its marker, the
  outputs are complete (markers come after the last barrier); it logs a warning and goes
  on. A rank that dies earlier is a failure, as before. The markers are removed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DONE_SUFFIX", "all_done", "clear_markers", "settle", "spawn_ranks"]

log = logging.getLogger(__name__)

DONE_SUFFIX = ".done"
SETTLE_TIMEOUT_S = 120.0  # a peer slower than this to reach its last barrier is stuck
_POLL_S = 0.01


def _marker(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}{DONE_SUFFIX}"


def all_done(out_dir: Path, world_size: int) -> bool:
    """True when every rank of ``world_size`` wrote its marker in ``out_dir``."""
    return all(_marker(out_dir, r).is_file() for r in range(world_size))


def settle(out_dir: Path, rank: int, world_size: int, *,
           timeout_s: float = SETTLE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic
           ) -> bool:
    """Mark ``rank`` finished and wait for every rank's marker (call after the last
    barrier, before ``destroy_process_group``). True when every marker was seen, or the
    directory is gone (renamed by rank 0 after it saw them all); False after
    ``timeout_s`` (the caller tears down anyway: a missing peer is reported by the
    launcher)."""
    _marker(out_dir, rank).touch()
    deadline = clock() + timeout_s
    while not all_done(out_dir, world_size):
        if not out_dir.is_dir():
            # Under torchrun, rank 0 renames the directory to its final name once its own
            # settle saw every marker: the others are done too.
            return True
        if clock() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def clear_markers(out_dir: Path, world_size: int) -> None:
    for r in range(world_size):
        _marker(out_dir, r).unlink(missing_ok=True)


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], world_size: int,
                out_dir: Path) -> None:
    """``torch.multiprocessing.start_processes(fn, args, world_size, spawn)``, joined.

    Raises what ``start_processes`` raises, except a rank exiting (a signal or a non-zero
    code) after every rank called :func:`settle`: that is logged and ignored.
    """
    import torch.multiprocessing as mp

    try:
        mp.start_processes(fn, args=args, nprocs=world_size, join=True, start_method="spawn")
    except mp.ProcessExitedException as e:
        if not all_done(out_dir, world_size):
            raise
        log.warning("rank %d exited with code %s after every rank had finished and written "
                    "its outputs (a gloo teardown abort); the outputs are complete, going on",
                    e.error_index, e.exit_code)
    finally:
        clear_markers(out_dir, world_size)
