"""The sidecar picks up the deltas published on the model volume: :class:`VolumeSync`.

**One chain per fleet.** In Kubernetes every pod's store is its own (an ``emptyDir``), so
a delta POSTed to one pod (the Service picks it) would live in that pod only, and the
next one built on it would be refused by every other pod. There the sidecar runs with
``--deltas-post refuse`` (:class:`serve.sidecar.config.SidecarConfig` ``deltas_post``):
the POST answers 409 naming where to publish instead, the model volume
(``<repository>/deltas/<version>/<model>-<version>-NNNNNNNN.delta``), which every pod's
:meth:`VolumeSync.sync` follows. ``store`` (the default) keeps the POST for one pod
(``make up``, tests, a hotfix by port-forward).
"""
from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from serve.errors import DeltaConflict, InsufficientMemory, ServeError
from serve.sidecar.services.deltas.intake import Accepted, DeltaIntake
from serve.store.deltas.signature import DeltaSignatureError

__all__ = ["VolumeSync"]

_log = logging.getLogger(__name__)

# A delta file on the model volume: anything ending in its 8-digit sequence + ".delta".
_VOLUME_FILE = re.compile(r"(\d{8})\.delta\Z")


class VolumeSync:
    """Takes the deltas of the served versions from the model volume through ``intake``
    (the same checks as a POST). Owns which files it has reported (each once) and
    whether a pass has completed, under one threading lock; :meth:`sync` is blocking
    (the sidecar runs it in a thread).

    Args:
        intake: what checks and stores each file, and counts the skipped ones.
        versions: the versions the pod serves now (``Sidecar.served_versions``).
    """

    def __init__(self, intake: DeltaIntake, versions: Callable[[], list[str]]) -> None:
        self.intake = intake
        self._versions = versions
        self._lock = threading.Lock()
        self._reported: set[tuple[Path, int | None, str]] = set()
        self._synced = False      # a sync pass over the model volume has completed

    @property
    def synced(self) -> bool:
        """Whether a pass over the model volume has completed (readiness waits for one)."""
        with self._lock:
            return self._synced

    def sync(self, roots: Iterable[Path]) -> list[Accepted]:
        """Pick up deltas published on the model volume: for each served version, the
        files ``<root>/deltas/<version>/*<seq:08d>.delta`` (what ``make delta`` writes,
        e.g. ``dlrm-small-int8-s0-00000001.delta``) whose sequence is above the store's,
        in sequence order, through the same checks as a POST
        (:meth:`DeltaIntake.receive_file`).

        This is how every pod of a Deployment gets the same deltas, including pods that
        start later (a new pod's store is empty: it replays the volume's deltas of its
        version before its workers' first batch settles). Each file's size is read
        (``stat``) before any byte: one over ``intake.max_bytes`` is skipped, never read.
        A file skipped or failing a check is logged once, counted once in
        ``dlrm_delta_files_skipped_total{reason}`` (``unsigned`` and ``bad_signature``
        with ``--delta-verify-key``: checked before a byte is copied), and stops that version's sync there
        (later ones need it). A pass always completes (readiness waits for one pass,
        never for a bad file).
        """
        out: list[Accepted] = []
        try:
            for version in self._versions():
                out += self._sync_version(version, roots)
        finally:
            with self._lock:
                self._synced = True
        return out

    def _volume_files(self, version: str, roots: Iterable[Path], last: int) -> dict[int, Path]:
        found: dict[int, Path] = {}
        for root in roots:
            folder = Path(root) / "deltas" / version
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for name in names:
                m = _VOLUME_FILE.search(name)
                if m and int(m.group(1)) > last:
                    found.setdefault(int(m.group(1)), folder / name)
        return found

    def _sync_version(self, version: str, roots: Iterable[Path]) -> list[Accepted]:
        out: list[Accepted] = []
        last = self.intake.store.last_sequence(version)
        found = self._volume_files(version, roots, last)
        max_bytes = self.intake.max_bytes
        for seq in sorted(found):
            if seq != last + 1:
                break  # a gap on the volume: wait for the missing one
            path = found[seq]
            try:
                size = path.stat().st_size
                if size > max_bytes:
                    self._skip(path, size, "too_large",
                               f"{size} bytes is over the {max_bytes}-byte limit of "
                               f"one delta (--max-delta-bytes); not read. Split it into "
                               f"smaller deltas or raise the limit (and the sidecar's memory)")
                    break
                accepted = self.intake.receive_file(path)
            except (ServeError, OSError) as e:
                reason = ("unreadable" if isinstance(e, OSError) else
                          "store_full" if isinstance(e, InsufficientMemory) else
                          e.reason if isinstance(e, DeltaSignatureError) else
                          "parent_mismatch" if isinstance(e, DeltaConflict)
                          and e.reason == "parent_mismatch" else "invalid")
                self._skip(path, None, reason, str(getattr(e, "message", e)))
                break
            _log.info("embedding delta %s #%d picked up from %s", version, seq, path)
            out.append(accepted)
            last = seq
        return out

    def _skip(self, path: Path, size: int | None, reason: str, why: str) -> None:
        """Log and count a volume file not taken, once per file (and size)."""
        key = (path, size, reason)
        with self._lock:
            if key in self._reported:
                return
            self._reported.add(key)
        self.intake.skipped.add(reason)
        _log.error("embedding delta %s from the model volume not taken (%s): %s", path,
                   reason, why)
