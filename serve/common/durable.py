"""Writes that survive a crash: the data and the rename reach the disk before we go on.

A rename (``os.replace``) is atomic, but without ``fsync`` a power loss or a kernel
crash can leave the new name pointing at an empty or half-written file (ext4 and xfs
reorder metadata and data): the reader then sees a truncated desired state or delta
instead of either the old or the new one. So every file the pod must trust after a
restart is written as: temporary file, write, ``fsync(file)``, ``os.replace``,
``fsync(folder)``.

When not to use: files that are rebuilt on every start anyway (caches, the workers'
status files), where the two fsyncs only cost time.

Temporary files (:func:`temp_beside`) get an unpredictable name, created with ``O_EXCL``
and ``O_NOFOLLOW`` (``tempfile.mkstemp``), mode 0600: some of these folders are shared
with the model container (the delta folder, TorchServe's model store), so a predictable
``<name>.tmp`` could be a symlink planted there and the write would follow it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["fsync_dir", "replace_durably", "temp_beside", "write_durably"]


def temp_beside(path: str | os.PathLike[str]) -> tuple[int, Path]:
    """A new temporary file in ``path``'s folder, for writing ``path`` by rename: its open
    descriptor (read-write) and its name (``.<name>.<random>.tmp``). Created exclusively
    (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600): a file or symlink already at a name is
    never opened, another name is tried. The caller closes the descriptor and renames or
    unlinks the file."""
    p = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    return fd, Path(name)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Flush ``folder``'s entries (a rename or an unlink in it) to the disk."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """``fsync`` the written ``tmp``, rename it to ``final``, ``fsync`` the folder."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def write_durably(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (module docstring); the folder is
    created when missing."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(p)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)
