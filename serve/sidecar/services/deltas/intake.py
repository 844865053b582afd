"""The sidecar takes an embedding delta into the pod's store: :class:`DeltaIntake`.

A delta (POSTed, :mod:`serve.sidecar.http.routes_deltas`, or found on the model volume,
:mod:`serve.sidecar.services.deltas.volume`) is checked completely before the store
changes, in this order, and any failure leaves the store as it was:

0. with a verify key (``--delta-verify-key``), its signature
   (:mod:`serve.store.deltas.signature`): read from the header before the file is
   scanned or stored (a POST once its body is in, within the size bounds of step 1), and
   for a volume file also before a byte is copied; 400 ``InvalidDelta`` field
   ``header.signature``, ``reason`` ``unsigned`` or ``bad_signature``. Without a key
   nothing is verified (:attr:`DeltaIntake.signatures` says ``not verified``);
1. the body size (413 over :attr:`DeltaIntake.max_bytes`, ``--max-delta-bytes``), while
   it streams into a file in the store's folder (hashed on the way; the body is never
   held in memory), and the store's bound (507 over ``--max-delta-store-bytes``);
2. the file itself, read back in chunks with only its ids loaded
   (:func:`serve.store.deltas.format.scan_delta_file`: magic, header, sizes, checksum;
   400 naming the field);
3. its base version is one the pod serves now, the stable version or a rollout's
   candidate (409 naming both);
4. it fits that version's tables (:func:`serve.store.deltas.layout.check_layout` against
   the build report's schema; 400 naming the field);
5. its sequence is the version's next one
   (:meth:`serve.store.deltas.files.DeltaStore.commit`; 409 for a gap or other bytes
   under a stored sequence). The same bytes again are stored once (outcome
   ``unchanged``); other bytes for a stored sequence whose file is damaged replace it
   (``repaired``: the workers, which retry a damaged delta every poll, then apply it);
6. it builds on what this pod holds (in the same step, under the store's lock): its
   ``parent_digest`` is the digest of the version's last stored delta, or for sequence 1
   the version's identity (:func:`serve.store.deltas.format.version_digest` of its build
   report); otherwise 409 ``DeltaConflict`` with ``reason`` ``parent_mismatch`` and both
   digests (``expected_parent_digest``: what this pod holds; ``parent_digest``: the
   delta's). A delta 1 written before the field existed is taken; a later one without it
   is 400. Then the file is fsynced, renamed into place and its folder fsynced.

Every refusal of a POST is counted by reason (``DeltaIntake.refused``, exported as
``dlrm_delta_posts_refused_total``, :data:`serve.metrics.DELTA_REFUSAL_REASONS`); a
volume file not taken is counted in ``DeltaIntake.skipped``
(``dlrm_delta_files_skipped_total``, ``parent_mismatch`` among its reasons). A stored
delta's id changes go to the intake's :class:`~serve.sidecar.services.deltas.idmaps.IdLedger`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.common.signing import VerifyKey
from serve.errors import (
    DeltaConflict,
    InsufficientMemory,
    InvalidDelta,
    PayloadTooLarge,
    ServeError,
)
from serve.sidecar.services.deltas.idmaps import IdLedger
from serve.store.deltas.files import DeltaStore
from serve.store.deltas.format import (
    CHUNK_BYTES,
    MAX_DELTA_BYTES,
    Delta,
    scan_delta_file,
    version_digest,
)
from serve.store.deltas.incoming import Incoming
from serve.store.deltas.layout import check_layout, layout_for_report
from serve.store.deltas.signature import (
    DeltaSignatureError,
    check_signature,
    read_file_header,
)

__all__ = ["Accepted", "DeltaIntake", "ReasonCounts", "refusal_reason"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """A delta that passed every check and is stored: ``outcome`` ``stored`` (new),
    ``unchanged`` (the same bytes were stored already) or ``repaired`` (it replaced a
    damaged stored file)."""

    version: str
    sequence: int
    rows: int
    bytes: int
    created_at: float
    outcome: str = "stored"


class DeltaIntake:
    """Checks a delta and commits it to the pod's store (module docstring); counts what
    it refuses and skips. Its only state is those counts (:class:`ReasonCounts`) and its
    id ledger, each behind its own lock; the store serializes the commits itself.

    Args:
        store: the pod's delta store (``--delta-dir``), shared with the workers.
        versions: the versions the pod serves now (``Sidecar.served_versions``).
        report_of: a version's build report (``ModelRepository.report``), for its tables
            and its identity.
        max_bytes: the largest delta (default
            :data:`serve.store.deltas.format.MAX_DELTA_BYTES`; the sidecar passes
            ``--max-delta-bytes``).
        max_store_bytes: the most bytes of deltas the store may hold, all versions and
            the body being received together (``--max-delta-store-bytes``); None: no
            bound. In Kubernetes the store is memory-backed and its pages are charged to
            the sidecar's container until their version stops being served, so this
            bound, not one delta's size, is what keeps the sidecar inside its memory.
        verify_key: the public key every delta must be signed with
            (``--delta-verify-key``); None: signatures are not verified.
    """

    def __init__(self, store: DeltaStore, *, versions: Callable[[], list[str]],
                 report_of: Callable[[str], dict[str, Any]], max_bytes: int | None = None,
                 max_store_bytes: int | None = None,
                 verify_key: VerifyKey | None = None) -> None:
        self.store = store
        self.verify_key = verify_key
        #: The largest delta accepted (bytes): POST bodies and volume files. The one limit
        #: of a delta; the request guard reads it here too.
        self.max_bytes = MAX_DELTA_BYTES if max_bytes is None else max_bytes
        self.max_store_bytes = max_store_bytes
        #: The id changes of the deltas this intake stored (read by the report).
        self.ids = IdLedger(store, self.max_bytes)
        #: POSTed deltas refused, by reason (:func:`refusal_reason`).
        self.refused = ReasonCounts()
        #: Volume files not taken, each counted once, by reason (``too_large``,
        #: ``invalid``, ``unreadable``, ``store_full``, ``parent_mismatch``,
        #: ``unsigned``, ``bad_signature``).
        self.skipped = ReasonCounts()
        self._versions = versions
        self._report_of = report_of

    # ------------------------------------------------------------------ checks

    @property
    def signatures(self) -> str:
        """``verified (key <id>)`` with a verify key, else ``not verified`` (GET /state,
        GET /embeddings/deltas)."""
        key = self.verify_key
        return "not verified" if key is None else f"verified (key {key.key_id})"

    def check_signed(self, path: Path) -> None:
        """Step 0 for the delta file ``path`` (its header only); nothing without a verify
        key.

        Raises:
            DeltaSignatureError: ``unsigned`` or ``bad_signature``.
            InvalidDelta: the header cannot be read. OSError: nor the file.
        """
        if self.verify_key is not None:
            check_signature(read_file_header(path), self.verify_key)

    def check_size(self, size: int) -> None:
        """Raise :class:`~serve.errors.PayloadTooLarge` for a body over :attr:`max_bytes`."""
        if size > self.max_bytes:
            raise PayloadTooLarge(
                f"body: {size} bytes is over the {self.max_bytes}-byte limit of one delta "
                f"(--max-delta-bytes); split the rows into several deltas (consecutive "
                f"sequence numbers)")

    def check_room(self, size: int, held: int | None = None) -> int:
        """Raise :class:`~serve.errors.InsufficientMemory` (507) when ``size`` more bytes
        would take the store's deltas past :attr:`max_store_bytes`; return the bytes held
        now (``held``, when the caller has read them already)."""
        held = self.store.delta_bytes() if held is None else held
        if self.max_store_bytes is not None and held + size > self.max_store_bytes:
            raise InsufficientMemory(
                f"body: {size} bytes would take the pod's delta store from {held} bytes past "
                f"its {self.max_store_bytes}-byte bound (--max-delta-store-bytes: the "
                f"deltas stay in memory until their version stops being served); fold the "
                f"deltas into a new version (make model / make import) and declare it, "
                f"or raise the bound together with the sidecar's memory limit")
        return held

    def check_served(self, delta: Delta) -> None:
        """Steps 3-4 of the module docstring: a served version, and its tables.

        Raises:
            DeltaConflict: its base version is not served here (409).
            InvalidDelta: it does not fit the version's tables (400).
        """
        served = self._versions()
        if delta.base_version not in served:
            raise DeltaConflict(
                "header.base_version",
                f"{delta.base_version!r} is not served by this pod, which serves "
                f"{served or 'no version (no desired state)'}; build the delta against "
                f"the stable version or the rollout's candidate (GET /state)",
                reason="base_version")
        check_layout(delta, layout_for_report(self._report_of(delta.base_version)))

    def base_digest(self, version: str) -> str:
        """The identity of ``version`` that its delta 1 names as ``parent_digest``
        (:func:`serve.store.deltas.format.version_digest` of its build report)."""
        return version_digest(self._report_of(version))

    # ------------------------------------------------------------------ accept

    async def receive(self, chunks: AsyncIterator[bytes]) -> Accepted:
        """Stream a delta body into the store: each chunk is written to a file in the
        store's folder and hashed on the way (never the whole body in memory), then the
        file is read back in chunks and validated (steps 2-4, only the ids in memory)
        and moved into place (step 5).

        Raises:
            PayloadTooLarge, InsufficientMemory, InvalidDelta, DeltaConflict: see the
            module docstring; nothing stays stored on any of them (each counted in
            ``refused``).
        """
        try:
            return await self._receive(chunks)
        except ServeError as e:
            self.refused.add(refusal_reason(e))
            raise

    async def _receive(self, chunks: AsyncIterator[bytes]) -> Accepted:
        held = await asyncio.to_thread(self.check_room, 0)
        incoming = await asyncio.to_thread(self.store.incoming, self.max_bytes)
        try:
            pending, size = bytearray(), 0
            async for chunk in chunks:
                size += len(chunk)
                self.check_size(size)
                self.check_room(size, held)
                pending += chunk
                if len(pending) >= CHUNK_BYTES:
                    await asyncio.to_thread(incoming.write, pending)
                    pending = bytearray()
            if pending:
                await asyncio.to_thread(incoming.write, pending)
        except BaseException:
            await asyncio.to_thread(incoming.discard)
            raise
        return await asyncio.to_thread(self.accept, incoming)

    def receive_file(self, path: Path) -> Accepted:
        """:meth:`receive` for a file (the model volume): copied in 1 MiB chunks
        (blocking I/O; refusals are not counted here: the volume sync counts its
        skips). With a verify key the file's signature is checked before any byte is
        copied, and again on the copy (the file may change in between)."""
        self.check_signed(path)
        self.check_room(path.stat().st_size)
        incoming = self.store.incoming(self.max_bytes)
        try:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    incoming.write(chunk)
        except BaseException:
            incoming.discard()
            raise
        return self.accept(incoming)

    def accept(self, incoming: Incoming) -> Accepted:
        """Steps 2-6 for a body fully received in ``incoming`` (blocking I/O): scan it,
        check it against the served versions, commit it, note its id changes.

        Raises:
            InvalidDelta, DeltaConflict: as the module docstring; ``incoming`` is
            dropped on every error.
        """
        try:
            incoming.finish()
            self.check_signed(incoming.path)
            delta = scan_delta_file(incoming.path, self.max_bytes)
            self.check_served(delta)
            base = self.base_digest(delta.base_version)
        except BaseException:
            incoming.discard()
            raise
        stored = self.store.commit(incoming, delta, self.max_bytes, base_digest=base)
        if stored.outcome != "unchanged":
            self.ids.record(delta, stored.path, count=stored.outcome == "stored")
        _log.info("embedding delta %s #%d %s (%d rows, %d bytes)", delta.base_version,
                  delta.sequence, stored.outcome, delta.rows, incoming.size)
        return Accepted(delta.base_version, delta.sequence, delta.rows, incoming.size,
                        delta.created_at, stored.outcome)


class ReasonCounts:
    """Events counted by a bounded reason label (a Prometheus counter's samples).
    Thread-safe: one lock over the counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str) -> None:
        """Count one event of ``reason``."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def counts(self) -> dict[str, int]:
        """The counts so far, by reason (a copy)."""
        with self._lock:
            return dict(self._counts)


def refusal_reason(error: ServeError) -> str:
    """The bounded reason label of a refused delta (:data:`serve.metrics.DELTA_REFUSAL_REASONS`):
    a :class:`~serve.errors.DeltaConflict`'s own ``reason`` (``base_version``,
    ``sequence``, ``parent_mismatch``, ``volume_only``), a signature's (``unsigned``,
    ``bad_signature``), ``invalid`` (400), ``too_large`` (413), ``store_full`` (507), else
    ``other``."""
    if isinstance(error, (DeltaConflict, DeltaSignatureError)):
        return error.reason
    if isinstance(error, InvalidDelta):
        return "invalid"
    if isinstance(error, PayloadTooLarge):
        return "too_large"
    if isinstance(error, InsufficientMemory):
        return "store_full"
    return "other"
