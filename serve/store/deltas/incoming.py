"""A delta body being received into the store's folder (:class:`Incoming`): written in
chunks, hashed on the way, bounded, then committed by
:meth:`serve.store.deltas.files.DeltaStore.commit` or discarded."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from serve.common.filemodes import private_opener
from serve.errors import PayloadTooLarge

__all__ = ["INCOMING_PREFIX", "Incoming"]

#: The name of a body being received starts with this (``.incoming.<pid>.<n>``).
INCOMING_PREFIX = ".incoming."


class Incoming:
    """A delta body being received into the store's folder (``.incoming.<pid>.<n>``):
    written chunk by chunk and hashed on the way, refused (413) as soon as it passes
    ``max_bytes``. :meth:`DeltaStore.commit` moves it into place; :meth:`discard` drops it.
    Never holds more than one chunk in memory."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.size = 0
        self._sha = hashlib.sha256()
        # closed by finish/discard; 0600: embedding rows are the model's (filemodes)
        self._file = open(path, "wb", opener=private_opener)  # noqa: SIM115

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk``.

        Raises:
            PayloadTooLarge: the body is now over ``max_bytes`` (nothing kept).
        """
        self.size += len(chunk)
        if self.size > self.max_bytes:
            self.discard()
            raise PayloadTooLarge(
                f"body: {self.size} bytes (so far) is over the {self.max_bytes}-byte limit "
                f"of one delta (--max-delta-bytes); split the rows into several deltas "
                f"(consecutive sequence numbers)")
        self._sha.update(chunk)
        self._file.write(chunk)

    def finish(self) -> None:
        """Flush and fsync the file (its bytes are on the disk before any rename); once."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    @property
    def sha256(self) -> str:
        """The sha256 of every byte written (the content hash re-posts are matched by)."""
        return self._sha.hexdigest()

    def discard(self) -> None:
        """Close and delete the file (any time; again is harmless)."""
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

