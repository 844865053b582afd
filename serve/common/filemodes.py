"""Modes of the local runtime files that hold what other users of the host must not
read: model tables, embedding deltas, request ids and scores, tokens (security review
N9). Files are created ``0600``, folders ``0700``, whatever the umask.

Example::

    with open(path, "wb", opener=private_opener) as f:   # 0600
        f.write(data)
    private_dir(folder)                                   # 0700 when it creates it
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["PRIVATE_DIR", "PRIVATE_FILE", "PRIVATE_UMASK", "private_dir", "private_opener"]

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
#: The umask the launcher starts TorchServe (and its workers) and the sidecar with: what
#: they create (metrics files, TorchServe's key file, archives) is this user's only.
PRIVATE_UMASK = 0o077


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """An ``opener`` for :func:`open`: creates ``path`` ``0600``, and narrows a file that
    already exists (one written before this rule, or under a wider umask) to ``0600``
    (where this user may; else it is left as it is)."""
    fd = os.open(path, flags, PRIVATE_FILE)
    with contextlib.suppress(OSError):
        os.fchmod(fd, PRIVATE_FILE)
    return fd


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and its missing parents) ``0700``; an existing folder is left as
    it is (it may be a mounted volume, or a folder the operator chose). Returns it."""
    p = Path(path)
    if not p.is_dir():
        p.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
        with contextlib.suppress(OSError):
            os.chmod(p, PRIVATE_DIR)  # mkdir's mode is masked by the umask
    return p
