"""The pod's delta store: one folder per pod, shared by the sidecar and the TorchServe
workers::

    <root>/<version>/00000001.delta      accepted deltas, immutable, in sequence order
    <root>/<version>/workers/<pid>.json  what each worker has applied (WorkerStatus)
    <root>/.incoming.<pid>.<n>           a body being received (Incoming)

The sidecar validates a posted delta completely (format, checksum, base version, the
model's tables, the next sequence number) and only then commits it; workers follow the
folder of their version and apply each delta once, in order, between two batches
(:mod:`serve.runtime.follower`).

**One chain per version.** A delta's *digest* is the sha256 of its file bytes
(:func:`~serve.store.deltas.format.file_sha256`; the store hashes a body while it
streams in). :meth:`DeltaStore.commit` takes a delta only when its ``parent_digest`` is
the store's head of that version, the digest of its last stored delta (the version's
identity, :func:`~serve.store.deltas.format.version_digest`, when none): two pods that
hold different deltas under one sequence number refuse each other's next delta (409
``DeltaConflict``, ``reason`` ``parent_mismatch``, naming both digests) instead of
drifting further apart.

Why the build report for sequence 1: it is what the pod already reads to check a delta
(its tables), a few KB, written once and read-only (versions are immutable), and it
differs between two builds of one name (``created_at``, ``build_fingerprint``,
``git_commit``...). The .mar or ``artifact.pt`` would identify the bytes served, but
hashing 59 MB (GBs at scale) per check is what the store must not do, and
``build_fingerprint`` alone is missing from imported versions (``make import``).

Deltas written before ``parent_digest`` existed: sequence 1 is still taken (a first
delta can only build on its version; what is lost is the check that it was built on this
very build of it); a later sequence is refused (400 ``header.parent_digest``: rebuild
it with ``make delta``, which writes the field).
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from serve.common.durable import fsync_dir, replace_durably
from serve.common.filemodes import private_dir
from serve.errors import DeltaConflict, InvalidDelta
from serve.state import VERSION_RE
from serve.store.deltas.format import (
    MAX_DELTA_BYTES,
    Delta,
    file_sha256,
    read_delta_file,
    scan_delta_file,
)
from serve.store.deltas.incoming import INCOMING_PREFIX, Incoming
from serve.store.deltas.status import WorkerStatus, read_statuses, write_status

__all__ = ["MAX_DELTA_STORE_BYTES", "DeltaStore", "Stored"]

#: The default bound on all the deltas the store holds (``--max-delta-store-bytes``): two
#: of the largest. Stored deltas stay until their version stops being served, charged to
#: the sidecar's container on a memory-backed folder, so its memory limit is sized from
#: this bound (docs/deltas.md, "Memory of the sidecar").
MAX_DELTA_STORE_BYTES = 2 * MAX_DELTA_BYTES
_FILE_RE = re.compile(r"^(\d{8})\.delta$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class Stored:
    """What :meth:`DeltaStore.commit` did: ``path`` the stored file; ``outcome``
    ``"stored"`` (a new sequence), ``"unchanged"`` (the same bytes were stored already:
    kept once) or ``"repaired"`` (the stored file was damaged; replaced)."""

    path: Path
    outcome: str


class _FileMemo(Generic[_T]):
    """One value per file (a digest, a damage verdict), kept while the file is the same
    (size, mtime, inode): a large delta is hashed once, not at every GET."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[Path, tuple[tuple[int, int, int], _T]] = {}

    def value(self, path: Path, st: os.stat_result, compute: Callable[[], _T]) -> _T:
        """The value kept for ``path`` as ``st`` describes it, else ``compute()`` (kept)."""
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            kept = self._kept.get(path)
        if kept is not None and kept[0] == key:
            return kept[1]
        got = compute()
        self.keep(path, st, got)
        return got

    def keep(self, path: Path, st: os.stat_result, value: _T) -> None:
        with self._lock:
            self._kept[path] = ((st.st_size, st.st_mtime_ns, st.st_ino), value)

    def forget(self, folder_or_file: Path) -> None:
        """Drop the values of ``folder_or_file`` and of every file under it."""
        with self._lock:
            self._kept = {p: v for p, v in self._kept.items()
                          if p != folder_or_file and folder_or_file not in p.parents}


class DeltaStore:
    """The pod's accepted deltas, one folder per version (module docstring).

    ``commit`` and the set of bodies being received share one lock; the digests and the
    damage verdicts are kept per file (:class:`_FileMemo`, each with its own lock)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._open: set[str] = set()           # incoming bodies being received now
        self._damage: _FileMemo[str | None] = _FileMemo()
        self._digests: _FileMemo[str] = _FileMemo()

    def folder(self, version: str) -> Path:
        if not re.fullmatch(VERSION_RE, version):
            raise InvalidDelta("base_version", f"{version!r} is not a version name")
        return self.root / version

    def path(self, version: str, sequence: int) -> Path:
        return self.folder(version) / f"{sequence:08d}.delta"

    def sequences(self, version: str) -> list[int]:
        """Accepted sequence numbers of ``version``, ascending."""
        try:
            names = os.listdir(self.folder(version))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _FILE_RE.fullmatch(n)))

    def last_sequence(self, version: str) -> int:
        seqs = self.sequences(version)
        return seqs[-1] if seqs else 0

    def incoming(self, max_bytes: int) -> Incoming:
        """A new :class:`Incoming` body in the store's folder (same filesystem as the
        versions' folders, so the final rename is atomic)."""
        private_dir(self.root)
        name = f"{INCOMING_PREFIX}{os.getpid()}.{next(self._counter)}"
        incoming = Incoming(self.root / name, max_bytes)
        with self._lock:
            self._open.add(name)
        return incoming

    def digest(self, version: str, sequence: int) -> str:
        """The sha256 (hex) of stored delta ``sequence`` of ``version``: what delta
        ``sequence + 1`` names as its parent. Cached per (size, mtime, inode): a delta the
        store received is not read again (its hash was taken while it streamed in).

        Raises:
            OSError: the file cannot be read (e.g. not stored).
        """
        path = self.path(version, sequence)
        return self._digests.value(path, path.stat(), lambda: file_sha256(path))

    def head_digest(self, version: str, base_digest: str | None) -> str | None:
        """What the next delta of ``version`` must name as ``parent_digest``: the digest of
        its last stored delta, or ``base_digest`` (:func:`version_digest`) when none."""
        last = self.last_sequence(version)
        return self.digest(version, last) if last else base_digest

    def commit(self, incoming: Incoming, delta: Delta, max_bytes: int | None = None, *,
               base_digest: str | None = None) -> Stored:
        """Move a received, validated delta into place as its version's file (fsync of
        the file and the folder first, so a crash leaves the old or the new state).

        The same bytes again (same sha256) are stored once (``unchanged``); other bytes for
        a stored sequence replace it only when the stored file is damaged (``repaired``:
        truncated, bad checksum). A new (or repairing) delta must name the store's head as
        its parent (module docstring): the digest of the previous sequence's file, or for
        sequence 1 ``base_digest`` (:func:`version_digest` of the base version's report;
        None: not checked, for callers without a report).

        Raises:
            DeltaConflict: its sequence is not ``last + 1``, nor a stored one it repeats
                or repairs; or its ``parent_digest`` is not the head (``reason``
                ``parent_mismatch``, both digests in ``details``). The incoming file is
                dropped; the store is unchanged.
            InvalidDelta: a sequence above 1 that names no parent (an old delta).
        """
        with self._lock:
            self._open.discard(incoming.path.name)
            try:
                return self._commit(incoming, delta, max_bytes, base_digest)
            finally:
                incoming.discard()  # gone after the rename; dropped on a refusal

    def _check_parent(self, delta: Delta, base_digest: str | None,
                      max_bytes: int | None) -> None:
        """``delta.parent_digest`` is what it must build on (:meth:`commit`)."""
        version, seq, got = delta.base_version, delta.sequence, delta.parent_digest
        if got is None:
            if seq == 1:
                return  # an old delta 1: it can only build on its version (module docstring)
            raise InvalidDelta(
                "header.parent_digest", f"missing: delta {seq} of version {version} does not "
                "name the delta it builds on (written before deltas named their parent); "
                "rebuild it with `make delta`, which writes parent_digest")
        if seq == 1:
            if base_digest is None or got == base_digest:
                return
            expected, held = base_digest, (f"this pod's build of version {version} (sha256 "
                                           f"of its build report)")
            todo = (f"the delta was built on another build of {version!r}: build it from "
                    f"the version this pod serves (the same model_store report)")
        else:
            expected = self.digest(version, seq - 1)
            if got == expected:
                return
            held = f"this pod's delta {seq - 1} of version {version}"
            why = self.damage(self.path(version, seq - 1), max_bytes)
            todo = (f"its stored file is damaged ({why}): re-post delta {seq - 1}'s bytes "
                    f"first" if why is not None else
                    "the delta belongs to another chain of deltas: build it on top of the "
                    "deltas this pod holds (GET /embeddings/deltas, head_digest), or "
                    "publish every delta of one chain on the model volume so that every "
                    "pod holds the same ones")
        raise DeltaConflict(
            "header.parent_digest",
            f"delta {seq} of version {version} builds on parent {got}, but {held} is "
            f"{expected}; nothing was changed. {todo[0].upper()}{todo[1:]}",
            reason="parent_mismatch",
            details={"parent_digest": got, "expected_parent_digest": expected})

    def _commit(self, incoming: Incoming, delta: Delta, max_bytes: int | None,
                base_digest: str | None) -> Stored:
        version, seq = delta.base_version, delta.sequence
        last = self.last_sequence(version)
        final = self.path(version, seq)
        outcome = "stored"
        if seq <= last and final.exists():
            if self.digest(version, seq) == incoming.sha256:
                return Stored(final, "unchanged")
            if self.damage(final, max_bytes) is None:
                raise DeltaConflict(
                    "header.sequence",
                    f"{seq} was already applied with other bytes: version {version} is at "
                    f"sequence {last}, so the next delta must be {last + 1}; deltas apply in "
                    f"order, once", reason="sequence")
            outcome = "repaired"
        elif seq != last + 1:
            raise DeltaConflict(
                "header.sequence",
                f"{seq} skips a delta: version {version} is at sequence {last}, so the next "
                f"delta must be {last + 1}; deltas apply in order, once", reason="sequence")
        self._check_parent(delta, base_digest, max_bytes)
        folder = self.folder(version)
        private_dir(folder)
        incoming.finish()
        replace_durably(incoming.path, final)
        fsync_dir(self.root)  # the version's folder itself, when it was just created
        self._damage.forget(final)
        # the hash taken while the body streamed in: not read again
        self._digests.keep(final, final.stat(), incoming.sha256)
        return Stored(final, outcome)

    def read(self, version: str, sequence: int) -> Delta:
        return read_delta_file(self.path(version, sequence))

    def damage(self, path: Path, max_bytes: int | None = None) -> str | None:
        """Why the stored delta ``path`` is damaged (truncated, bad checksum, unreadable),
        or None when it reads back whole. Cached per (size, mtime, inode): the checksum of
        a large delta is computed once, not at every GET."""
        try:
            st = path.stat()
        except OSError as e:
            return f"unreadable: {e}"
        return self._damage.value(path, st, lambda: _why_damaged(path, max_bytes))

    def damaged(self, version: str, max_bytes: int | None = None) -> list[tuple[str, str]]:
        """(file name, reason) of each damaged stored delta of ``version``."""
        out = []
        for seq in self.sequences(version):
            why = self.damage(self.path(version, seq), max_bytes)
            if why is not None:
                out.append((self.path(version, seq).name, why))
        return out

    def remove_version(self, version: str) -> int:
        """Delete ``version``'s folder (its deltas, workers' statuses and shared table);
        the bytes it held."""
        folder = self.folder(version)
        held = sum(_size(p) for p in _files(folder))
        shutil.rmtree(folder, ignore_errors=True)
        self._damage.forget(folder)
        self._digests.forget(folder)
        if self.root.exists():
            fsync_dir(self.root)
        return held

    def drop_stale_incoming(self) -> int:
        """Delete bodies left half-received by a process that died (not the ones being
        received now); how many."""
        try:
            names = [n for n in os.listdir(self.root) if n.startswith(INCOMING_PREFIX)]
        except FileNotFoundError:
            return 0
        with self._lock:
            stale = [n for n in names if n not in self._open]
        for name in stale:
            (self.root / name).unlink(missing_ok=True)
        return len(stale)

    def held_bytes(self, skip_tables_of: Sequence[str] = ()) -> int:
        """Bytes of every file in the store, less the shared tables (``tables.bin``) of
        ``skip_tables_of`` (versions whose live workers map them: counted in their RSS)."""
        skip = {self.root / v / "tables.bin" for v in skip_tables_of}
        return sum(_size(p) for p in _files(self.root) if p not in skip)

    def delta_bytes(self) -> int:
        """Bytes of the stored deltas (every version's ``*.delta``) and of bodies being
        received: what the sidecar itself has put in the store (the workers' shared
        ``tables.bin`` and status files are theirs)."""
        return sum(_size(p) for p in _files(self.root)
                   if p.suffix == ".delta" or p.name.startswith(INCOMING_PREFIX))

    def write_worker_status(self, status: WorkerStatus) -> None:
        """Replace ``status``'s file (``<version>/workers/<pid>.json``) atomically."""
        write_status(self.folder(status.version) / "workers", status)

    def worker_statuses(self, version: str, pids: Sequence[int] | None = None
                        ) -> list[WorkerStatus]:
        """The workers' statuses of ``version`` (only ``pids`` when given: the live ones)."""
        return read_statuses(self.folder(version) / "workers", pids)

    def versions(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root)
                          if re.fullmatch(VERSION_RE, n) and (self.root / n).is_dir())
        except FileNotFoundError:
            return []


def _files(folder: Path) -> Iterator[Path]:
    """Every regular file under ``folder`` (none when it is missing)."""
    for dirpath, _, names in os.walk(folder):
        for name in names:
            p = Path(dirpath) / name
            try:
                if p.is_file():
                    yield p
            except OSError:
                continue


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _why_damaged(path: Path, max_bytes: int | None) -> str | None:
    """Why the delta file ``path`` does not read back whole, or None."""
    try:
        scan_delta_file(path, max_bytes)
    except InvalidDelta as e:
        return e.message
    except OSError as e:
        return f"unreadable: {e}"
    return None
