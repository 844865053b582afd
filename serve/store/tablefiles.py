"""A version's embedding tables on local disk: one raw file per table, written once.

Layout of one tables folder (``<model>-<version>.tables/`` beside the version's archive in
the model store, see :mod:`serve.store.repository`)::

    manifest.json     {"format": 1, "tables": [{"name", "rows", "dim", "dtype",
                        "row_bytes", "file", "sha256"}, ...]}   (written last)
    t000.rows         table 0: rows x row_bytes uint8, row-major, no header
    t001.rows         ...

Each row is one row of :mod:`serve.rowformat` at the table's own width (no padding to the
widest table): disk per version is its table bytes plus the manifest. A file name is
``t<index>.rows`` (never the table's name: names are the user's, files are ours).

Why raw files and not a ``torch.save`` blob inside the ``.mar``: a reader maps them in
place (no unpack copy, no second copy per pod; the page cache holds each page once for
every worker) or reads single rows with ``pread`` (the disk tier), and a writer streams
them chunk by chunk (an import holds one chunk, never the model).

Writing is all or nothing: :class:`TableWriter` writes into ``<folder>.tmp-<pid>`` and
renames it to ``<folder>`` at :meth:`TableWriter.commit`, after every table is complete
and the manifest (with each file's SHA-256, hashed as it streams) is written; an
aborted or failed writer removes what it wrote.

Example::

    specs = [TableSpec("t_user", 1000, 64, "int8"), ...]
    with TableWriter(Path("model_store/dlrm-v1.tables"), specs) as w:
        for start, chunk in chunks:            # uint8 (n, row_bytes), in row order
            w.write(0, start, chunk)
        manifest = w.commit()
    files = TableFiles.open(Path("model_store/dlrm-v1.tables"))
    files.array(0)                             # uint8 (rows, row_bytes), mapped
    files.read_rows(0, np.array([5, 17]))      # uint8 (2, row_bytes), by pread
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

import numpy as np

from serve.errors import ArtifactError, ConfigError
from serve.rowformat import row_bytes

__all__ = ["MANIFEST_NAME", "TABLES_FORMAT", "TABLES_SUFFIX", "TableEntry", "TableFiles",
           "TableManifest", "TableShape", "TableWriter", "tables_folder_bytes"]

#: The folder beside an archive: ``<model>-<version>`` + this suffix.
TABLES_SUFFIX = ".tables"
MANIFEST_NAME = "manifest.json"
#: The format :class:`TableWriter` writes and :class:`TableFiles` reads.
TABLES_FORMAT = 1


class TableShape(Protocol):
    """What a writer needs of a table (``serve.schema.TableSpec`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class TableEntry:
    """One table file of a manifest: ``rows`` x ``row_bytes`` uint8 in ``file``."""

    name: str
    rows: int
    dim: int
    dtype: str
    row_bytes: int
    file: str
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "dim": self.dim, "dtype": self.dtype,
                "row_bytes": self.row_bytes, "file": self.file, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> TableEntry:
        keys = ("name", "rows", "dim", "dtype", "row_bytes", "file", "sha256")
        if not isinstance(d, dict) or any(k not in d for k in keys):
            raise ArtifactError(f"{where}: a table entry needs the keys {list(keys)}, got "
                                f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        e = cls(str(d["name"]), int(d["rows"]), int(d["dim"]), str(d["dtype"]),
                int(d["row_bytes"]), str(d["file"]), str(d["sha256"]))
        if e.row_bytes != row_bytes(e.dtype, e.dim) or e.rows < 0:
            raise ArtifactError(f"{where}: table {e.name} says {e.rows} rows of "
                                f"{e.row_bytes} bytes; dtype {e.dtype} dim {e.dim} rows are "
                                f"{row_bytes(e.dtype, e.dim)} bytes")
        if "/" in e.file or e.file.startswith("."):
            raise ArtifactError(f"{where}: table file {e.file!r} must be a plain name")
        return e


@dataclass(frozen=True)
class TableManifest:
    """The tables of one version, in the schema's table order."""

    tables: tuple[TableEntry, ...]
    format: int = TABLES_FORMAT

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def identity(self) -> str:
        """A digest naming these tables' bytes (from the files' SHA-256s): two builds of
        a version name differ here."""
        h = hashlib.sha256()
        for t in self.tables:
            h.update(f"{t.name};{t.rows}x{t.row_bytes};{t.sha256};".encode())
        return h.hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> TableManifest:
        if not isinstance(d, dict) or d.get("format") != TABLES_FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ArtifactError(f"{where}: tables format {got!r}; this runtime reads format "
                                f"{TABLES_FORMAT}; rebuild or re-import the version")
        tables = d.get("tables")
        if not isinstance(tables, list):
            raise ArtifactError(f"{where}: 'tables' must be a list")
        return cls(tuple(TableEntry.from_dict(t, where) for t in tables))


def _file_name(i: int) -> str:
    return f"t{i:03d}.rows"


class TableWriter:
    """Streams the rows of a new tables folder; nothing is visible before :meth:`commit`.

    Rows of each table are written in order (``start`` must be where the table's rows
    end so far): the file's SHA-256 is hashed as it streams, so no table is read back.

    Args:
        folder: the folder to create (``<model>-<version>.tables``); it must not exist.
        tables: the tables, in the schema's order (name, rows, dim, dtype).
    """

    def __init__(self, folder: str | os.PathLike[str], tables: Sequence[TableShape]) -> None:
        self.folder = Path(folder)
        if self.folder.exists():
            raise ConfigError(f"tables folder {self.folder} exists; a version's tables are "
                              "written once (pick another version)")
        self.tmp = self.folder.with_name(f"{self.folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._shapes = [(t.name, int(t.rows), int(t.dim), str(t.dtype)) for t in tables]
        self._row_bytes = [row_bytes(dt, dim) for _, _, dim, dt in self._shapes]
        self._written = [0] * len(self._shapes)
        self._hash = [hashlib.sha256() for _ in self._shapes]
        # one open file per table for the writer's life (closed by commit or abort)
        self._files = [open(self.tmp / _file_name(i), "wb")  # noqa: SIM115
                       for i in range(len(self._shapes))]
        self._done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    @property
    def row_bytes(self) -> list[int]:
        """Bytes per row of each table."""
        return list(self._row_bytes)

    def written(self, table: int) -> int:
        """Rows of ``table`` written so far."""
        return self._written[table]

    def write(self, table: int, start: int, rows: Any) -> None:
        """Append rows ``start .. start + n`` of ``table``: uint8 (n, row_bytes), a numpy
        array or a CPU tensor (anything with ``.numpy()`` or the buffer protocol).

        Raises:
            ArtifactError: the rows are not the next ones, or have the wrong shape.
        """
        name, total, _, _ = self._shapes[table]
        rb = self._row_bytes[table]
        arr = rows.numpy() if hasattr(rows, "numpy") else np.asarray(rows)
        if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != rb:
            raise ArtifactError(f"table {name}: rows must be uint8 (n, {rb}), got {arr.dtype} "
                                f"{tuple(arr.shape)}")
        if start != self._written[table] or start + arr.shape[0] > total:
            raise ArtifactError(f"table {name}: rows {start}..{start + arr.shape[0]} do not "
                                f"follow the {self._written[table]} written (of {total})")
        buf = np.ascontiguousarray(arr).data
        self._files[table].write(buf)
        self._hash[table].update(buf)
        self._written[table] += arr.shape[0]

    def commit(self) -> TableManifest:
        """Close and flush every file, write the manifest, and rename the folder into place.

        Raises:
            ArtifactError: a table is incomplete (nothing is kept).
        """
        try:
            short = [f"{n} ({w} of {r})" for (n, r, _, _), w in zip(self._shapes, self._written,
                                                                     strict=True) if w != r]
            if short:
                raise ArtifactError(f"tables incomplete: {', '.join(short)} rows written")
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            manifest = TableManifest(tuple(
                TableEntry(n, r, d, dt, rb, _file_name(i), h.hexdigest())
                for i, ((n, r, d, dt), rb, h) in enumerate(
                    zip(self._shapes, self._row_bytes, self._hash, strict=True))))
            (self.tmp / MANIFEST_NAME).write_text(json.dumps(manifest.to_dict(), indent=1))
            os.replace(self.tmp, self.folder)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return manifest

    def abort(self) -> None:
        """Remove everything written (idempotent)."""
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True


class TableFiles:
    """A committed tables folder, open for reading: mapped arrays and ``pread`` rows.

    Opening reads the manifest and checks each file's size (no table byte is read).
    Not thread-safe for :meth:`close`; :meth:`read_rows` may run from many threads.
    """

    def __init__(self, folder: Path, manifest: TableManifest) -> None:
        self.folder = folder
        self.manifest = manifest
        self._fds: list[int] = []
        try:
            for t in manifest.tables:
                path = folder / t.file
                fd = os.open(path, os.O_RDONLY)
                self._fds.append(fd)
                size = os.fstat(fd).st_size
                if size != t.nbytes:
                    raise ArtifactError(f"table file {path} is {size} bytes; its manifest "
                                        f"says {t.rows} rows x {t.row_bytes} = {t.nbytes}; "
                                        "the version is damaged: rebuild or re-import it")
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> TableFiles:
        """Open ``folder`` (written by :class:`TableWriter`).

        Raises:
            ArtifactError: the folder, its manifest or a file is missing or inconsistent.
        """
        folder = Path(folder)
        path = folder / MANIFEST_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"tables folder {folder} has no {MANIFEST_NAME}; the version's "
                                "tables are missing or were not written to the end: rebuild "
                                "or re-import it") from None
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{path} is unreadable ({e}); rebuild or re-import it") from e
        return cls(folder, TableManifest.from_dict(data, str(path)))

    @property
    def tables(self) -> tuple[TableEntry, ...]:
        return self.manifest.tables

    @property
    def nbytes(self) -> int:
        """Table bytes on disk (the manifest not counted)."""
        return self.manifest.nbytes

    def fd(self, table: int) -> int:
        """The read-only descriptor of ``table``'s file (``os.pread`` from any thread)."""
        return self._fds[table]

    def array(self, table: int) -> np.ndarray:
        """uint8 (rows, row_bytes) mapped from the file, copy-on-write: reading faults
        pages in from the page cache (shared by every process mapping it); a write lands
        in pages private to this process and never reaches the file."""
        t = self.manifest.tables[table]
        if t.nbytes == 0:
            return np.zeros((0, t.row_bytes), dtype=np.uint8)
        return np.memmap(self.folder / t.file, dtype=np.uint8, mode="c",
                         shape=(t.rows, t.row_bytes))

    def read_rows(self, table: int, rows: np.ndarray, out: np.ndarray | None = None
                  ) -> np.ndarray:
        """Rows ``rows`` (int64 (n,)) of ``table`` read with one ``pread`` each, in this
        thread: uint8 (n, row_bytes), written into ``out`` when given.

        Raises:
            ArtifactError: a row is out of range or the file is shorter than its manifest.
        """
        t = self.manifest.tables[table]
        n = int(rows.shape[0])
        if out is None:
            out = np.empty((n, t.row_bytes), dtype=np.uint8)
        if n and (int(rows.min()) < 0 or int(rows.max()) >= t.rows):
            raise ArtifactError(f"table {t.name}: rows must be in 0..{t.rows - 1}")
        fd, rb = self._fds[table], t.row_bytes
        for j, r in enumerate(rows.tolist()):
            got = os.preadv(fd, [out[j]], r * rb)
            if got != rb:
                raise ArtifactError(f"table {t.name}: row {r} read {got} of {rb} bytes; the "
                                    "file is shorter than its manifest")
        return out

    def verify(self) -> list[str]:
        """Every table whose file's SHA-256 differs from the manifest (reads every byte:
        an offline check, never done at load)."""
        bad = []
        for i, t in enumerate(self.manifest.tables):
            h = hashlib.sha256()
            with open(self.folder / t.file, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
            if h.hexdigest() != t.sha256:
                bad.append(f"{t.name} ({self.folder / _file_name(i)})")
        return bad

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []


def tables_folder_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of every file in a tables folder (what a version costs on disk)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
