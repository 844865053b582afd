"""One host copy of a version's embedding tables for every worker of a pod.

Each TorchServe worker is its own process. Without sharing, each copies the tables into
its own memory (2 workers x 57 MB on ``small``, 2 x 2.3 GB at criteo-kaggle scale). Here
the first worker writes the concatenated tables, uint8 (R, row_bytes), once into a file
(``tables.bin`` in the version's delta folder, see :mod:`serve.store.deltas`) and every worker
maps it ``MAP_SHARED``: the pages live once, in the page cache (tmpfs or disk-backed),
whatever the number of workers.

Managed tables' id maps (:class:`serve.runtime.idmap.MapIndex`: an int64 region of
fixed size) live in the same file, after the rows (8-byte aligned): one copy per pod, and
a delta's admissions and evictions are written into it once, like its rows, under the
same lock.

Deltas write into that one mapping, so they must never land under a batch that is
reading it: a batch holds the **read** side of a cross-process reader-writer lock
(``flock`` on ``tables.lock``) for its whole forward, and a delta is written under the
**write** side. Plain ``flock`` does not stop new readers from overtaking a waiting
writer (two busy workers would starve it), so both sides first pass a turnstile
(``tables.turn``, exclusive, held by a writer until it is done; a reader only passes
through): a writer waits for at most the batches already running. Cost per batch: three
``flock`` calls, a few microseconds.

``tables.seq`` holds the sequence number of the newest delta written into the mapping,
so the first worker to take the write side writes a delta and the others only record
that they see it (each worker's view gets every delta exactly once).

``tables.id`` names the build the file was written from (:func:`tables_identity`: a
digest of the shapes and of up to 256 evenly spread rows of every table of the
artifact, and of the id maps' own identity, :class:`IdRegion`). A version name can come
back with other weights (``make clean-models`` and a rebuild, a store restored from
elsewhere) while the delta folder survives: a file of
the right size but another build's rows would serve those rows under the new dense
layers, a silent wrong answer. So a file whose identity is missing or differs is
written afresh (and its deltas re-applied by the followers, from sequence 0). Deltas
change the file's rows, never the identity it was written for.

The id map region is built only by the worker that writes the file
(:attr:`IdRegion.build`: hashing every admitted id into its slots, seconds per worker at
criteo scale); the others map what it wrote, recognised by the identity.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.common.durable import temp_beside
from serve.common.filemodes import private_dir, private_opener
from serve.errors import ArtifactError

__all__ = ["IdRegion", "SharedTables", "spread_sample", "tables_identity"]

#: Rows per table that :func:`tables_identity` hashes (evenly spread, first and last).
IDENTITY_ROWS = 256


@dataclass(frozen=True)
class IdRegion:
    """The managed tables' id map region that the file holds after the rows.

    Attributes:
        size: its int64 elements.
        identity: names its content, without building it (the build's maps and the
            region's layout: :func:`serve.runtime.idmap.MapIndex.identity`).
        build: the region, int64 (size,); called only when the file is written.
    """
    size: int
    identity: str
    build: Callable[[], torch.Tensor]


def tables_identity(tables: list[torch.Tensor], id_region: IdRegion | None = None) -> str:
    """A digest naming the build ``tables`` come from: the shape of each uint8
    (rows_t, row_bytes) table and up to :data:`IDENTITY_ROWS` evenly spread rows of each
    (the first and last included), and ``id_region``'s identity. Two trainings differ in
    every row, so a sample tells builds apart; reading it costs microseconds where hashing
    every row of a 2 GB table would cost seconds per worker."""
    h = hashlib.sha256()
    if id_region is not None:   # the build's id maps: part of what the file holds
        h.update(f"maps{id_region.size};{id_region.identity};".encode())
    for t in tables:
        h.update(f"{int(t.shape[0])}x{int(t.shape[1])};".encode())
        h.update(spread_sample(t, IDENTITY_ROWS))
    return h.hexdigest()[:32]


def spread_sample(t: torch.Tensor, k: int) -> bytes:
    """The bytes of up to ``k`` evenly spread rows (along dim 0) of CPU tensor ``t``, the
    first and last included: what an identity digest reads of an array too large to hash
    whole."""
    n = int(t.shape[0])
    if not n:
        return b""
    k = min(n, k)
    picks = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    return (t.index_select(0, torch.tensor(picks, dtype=torch.long))
            .contiguous().numpy().tobytes())

log = logging.getLogger(__name__)


def _replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` by rename from a temporary file of an unpredictable name
    (:func:`serve.common.durable.temp_beside`: the delta folder is the model container's
    too, and a predictable name could be a planted symlink)."""
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class SharedTables:
    """The shared table file of one version, its locks and its sequence number.

    Args:
        path: the table file (``<delta_dir>/<version>/tables.bin``); its folder is created.
        max_sequence: the newest delta the store holds for the version: a file claiming a
            newer one (the store was emptied behind it) is written afresh by :meth:`open`.
    """

    def __init__(self, path: str | os.PathLike[str], max_sequence: int = 0) -> None:
        self.path = Path(path)
        self.max_sequence = max_sequence
        private_dir(self.path.parent)
        base = self.path.with_suffix("")
        # One descriptor each per process (flock locks belong to the open file); 0600,
        # as every file here (serve.common.filemodes).
        self._rw = private_opener(f"{base}.lock", os.O_RDWR | os.O_CREAT)
        self._turn = private_opener(f"{base}.turn", os.O_RDWR | os.O_CREAT)
        self._seq_path = Path(f"{base}.seq")
        self._id_path = Path(f"{base}.id")
        #: The managed tables' id map region in the file (int64), after :meth:`open` was
        #: given one; None otherwise.
        self.id_region: torch.Tensor | None = None

    def close(self) -> None:
        for fd in (self._rw, self._turn):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- locks -------------------------------------------------------------------------
    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        """Held by a batch for its whole forward: no delta is written meanwhile."""
        fcntl.flock(self._turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._rw, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._rw, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """Exclusive: waits for the batches running in every worker, blocks new ones."""
        fcntl.flock(self._turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._rw, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._rw, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._turn, fcntl.LOCK_UN)

    # -- the sequence written into the mapping -----------------------------------------
    def sequence(self) -> int:
        """The newest delta written into the file (0: none). Read under a lock."""
        try:
            return int(self._seq_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def set_sequence(self, seq: int) -> None:
        """Record that delta ``seq`` is in the file; call under :meth:`write`."""
        _replace_text(self._seq_path, str(int(seq)))

    def _identity(self) -> str | None:
        """The build identity the file was written for (None: unknown). Under a lock."""
        try:
            return self._id_path.read_text().strip() or None
        except FileNotFoundError:
            return None

    def _set_identity(self, ident: str) -> None:
        _replace_text(self._id_path, ident)

    @staticmethod
    def _region_bytes(id_region: IdRegion) -> memoryview:
        region = id_region.build()
        if region.dtype != torch.int64 or region.numel() != id_region.size:
            raise ArtifactError(f"the id map region built is {region.dtype} "
                                f"({region.numel()},), its layout says int64 "
                                f"({id_region.size},)")
        return region.cpu().contiguous().numpy().data

    # -- the mapping -------------------------------------------------------------------
    def open(self, tables: list[torch.Tensor], id_region: IdRegion | None = None
             ) -> torch.Tensor:
        """The shared table, uint8 (R, row_bytes), mapped ``MAP_SHARED``.

        The first caller writes the file from ``tables`` (each uint8 (rows_t, row_bytes),
        in feature order; typically memory-mapped from the artifact) and ``id_region``
        (the build's id maps, built only then; :attr:`id_region` is its view in the
        file); later callers map it. A file whose size does not match, or that claims a
        delta newer than ``max_sequence``, is written afresh.

        Raises:
            ArtifactError: the tables have different row widths.
        """
        widths = {int(t.shape[1]) for t in tables}
        if len(widths) != 1:
            raise ArtifactError(f"tables mix row widths {sorted(widths)}")
        rb = widths.pop()
        rows = sum(int(t.shape[0]) for t in tables)
        table_bytes = rows * rb
        pad = -table_bytes % 8 if id_region is not None else 0
        nmaps = id_region.size if id_region is not None else 0
        nbytes = table_bytes + pad + 8 * nmaps
        ident = tables_identity(tables, id_region)
        with self.write():
            size = self.path.stat().st_size if self.path.exists() else -1
            seq = self.sequence()
            held = self._identity()
            if size != nbytes or seq > self.max_sequence or held != ident:
                why = ("missing" if size < 0 else f"{size} bytes, expected {nbytes}"
                       if size != nbytes else f"at delta {seq}, the store holds {self.max_sequence}"
                       if seq > self.max_sequence else
                       f"written from another build of the version (identity {held}, this "
                       f"artifact's {ident})")
                log.info("shared tables %s: writing %d rows x %d bytes (%s)", self.path, rows,
                         rb, why)
                fd, tmp = temp_beside(self.path)
                try:
                    with os.fdopen(fd, "wb") as f:
                        # memoryviews of the (memory-mapped) tables: no second copy
                        f.writelines(t.contiguous().numpy().data for t in tables)
                        if id_region is not None:
                            f.write(b"\0" * pad)
                            f.write(self._region_bytes(id_region))
                    os.replace(tmp, self.path)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                self.set_sequence(0)
                self._set_identity(ident)
            storage = torch.UntypedStorage.from_file(os.fspath(self.path), shared=True,
                                                     nbytes=nbytes)
        whole = torch.empty(0, dtype=torch.uint8)
        whole.set_(storage)  # type: ignore[arg-type]
        if id_region is not None:
            self.id_region = whole[table_bytes + pad:].view(torch.int64)
        return whole[:table_bytes].view(rows, rb)
