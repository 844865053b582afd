"""The desired-state file: read by path, written atomically, never held open.

The reconciler (:mod:`serve.sidecar.control.reconciler`) is its only reader that acts on
what it reads: its pass calls :meth:`DesiredStateFile.read` and keeps the result as its
snapshot. The write paths (PUT /state, PUT /batching, a rollout's outcome) write through
:meth:`DesiredStateFile.write` and wake it. Every method here is a plain function of the
file: nothing is cached, so two readers can never disagree about what they hold.

Every write is atomic and durable (:func:`serve.state.write_state`: temporary
file, fsync, rename, fsync of the folder): after a crash the file holds the old or the
new state, never an empty or half-written one.

The file is read by path every time (a ConfigMap update swaps a symlink: holding an
inode would miss it). Where it is read-only (a ConfigMap mount), a write is refused with
a :class:`~serve.errors.Conflict` saying to edit the ConfigMap instead.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from serve.errors import ConfigError, Conflict
from serve.state import (
    STATE_MAX_BYTES,
    DesiredState,
    dump_state,
    parse_state,
    read_state_yaml,
    write_state,
)

__all__ = ["DesiredStateFile", "FileRead", "digest", "write_state"]

_log = logging.getLogger(__name__)


def digest(data: bytes) -> str:
    """The content hash a change of the file is seen by."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileRead:
    """One read of the file: the hash of what was read (None when it could not be read),
    the desired state parsed from it (None when it does not parse) and why not."""

    digest: str | None
    state: DesiredState | None
    error: str | None


class DesiredStateFile:
    """The desired-state file at ``path`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> FileRead:
        """Read and parse the file now; changes nothing."""
        try:
            with open(self.path, "rb") as f:  # one byte past the limit tells it is over
                data = f.read(STATE_MAX_BYTES + 1)
        except FileNotFoundError:
            return FileRead(None, None, f"desired-state file {self.path} does not exist; "
                            "PUT /state or write it (format: serve/state.py)")
        except OSError as e:
            return FileRead(None, None,
                            f"desired-state file {self.path} could not be read: {e}")
        hashed = digest(data)
        try:
            parsed = read_state_yaml(data, f"desired-state file {self.path}")
            return FileRead(hashed, parse_state(parsed, source=str(self.path)), None)
        except ConfigError as e:
            return FileRead(hashed, None, e.message)

    def digest(self) -> str | None:
        """The hash of the file's content now (None when it cannot be read)."""
        try:
            return digest(self.path.read_bytes())
        except OSError:
            return None

    def writable_error(self) -> str | None:
        """Why the file cannot be written (None when it can): a read-only file or folder,
        as a ConfigMap mount is."""
        if self.path.exists() and not os.access(self.path, os.W_OK):
            return self.read_only(f"{self.path} is not writable")
        folder = self.path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not os.access(folder, os.W_OK):
            return self.read_only(f"its folder {folder} is not writable")
        return None

    def read_only(self, detail: str) -> str:
        """The message for a refused write: where the desired state is changed instead."""
        return (f"the desired-state file {self.path} is read-only ({detail}). In Kubernetes "
                f"it is the ConfigMap dlrm-serving-state mounted into the pod: change it "
                f"there (`kubectl edit configmap dlrm-serving-state`, or edit the manifest "
                f"and `kubectl apply -f` it); every pod applies it once kubelet updates the "
                f"mount (up to a minute)")

    def write(self, desired: DesiredState) -> str:
        """Write ``desired`` atomically; the hash of what was written.

        Raises:
            Conflict: the file is read-only (the message says to edit the ConfigMap).
        """
        why = self.writable_error()
        if why is not None:
            raise Conflict(why)
        try:
            write_state(self.path, desired)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise Conflict(self.read_only(str(e))) from None
            raise
        return digest(dump_state(desired).encode())

    def replace(self, written: DesiredState, previous: DesiredState) -> bool:
        """Put ``previous`` back if the file still holds exactly ``written`` (nobody wrote
        since); True if it did."""
        try:
            if self.path.read_bytes() != dump_state(written).encode():
                return False
            write_state(self.path, previous)
        except OSError as e:
            _log.error("could not restore the desired state in %s: %s", self.path, e)
            return False
        return True

    def write_outcome(self, settled: DesiredState) -> bool:
        """Write a rollout's outcome where the file is writable; True if it was written
        (where read-only the outcome holds in memory only: logged)."""
        why = self.writable_error()
        if why is not None:
            _log.warning("rollout outcome not written (%s); update the desired state to %s "
                         "to make it durable", why, settled.serving_version())
            return False
        try:
            write_state(self.path, settled)
        except OSError as e:
            _log.error("could not write the rollout's outcome into %s: %s", self.path, e)
            return False
        return True
