"""Who made a delta: the ed25519 signature in its header, written and checked.

The checksum (``sha256``) and ``parent_digest`` give integrity and order; they do not
say who built the delta: whoever can write the volume the deltas come from can write a
valid one. A *signed* delta carries, in its header::

    "signature": {"alg": "ed25519", "key_id": "<16 hex>", "value": "<base64, 64 bytes>"}

over the message :func:`delta_message`: the domain tag ``dlrm-delta/1`` and the canonical
JSON of the delta's ``base_version``, ``sequence``, ``parent_digest`` and ``sha256``. The
checksum covers the whole header (less ``sha256`` and ``signature``) and the payload, so
the signature binds every row byte; the other three fields are signed by name as well so
the message alone says which delta of which chain it is.

A pod that has a verify key (``--delta-verify-key``) checks the signature *before* it
takes a delta (:func:`check_signature`), and the checksum it signs when it scans the
file, so a delta whose rows were changed after signing fails the checksum, and one whose
header was changed fails the signature. Refusals name the field ``header.signature`` with
a reason (:class:`DeltaSignatureError`): ``unsigned`` or ``bad_signature``.
"""
from __future__ import annotations

import os
from typing import Any

from serve.common.signing import BadSignature, SigningKey, VerifyKey, signed_message
from serve.errors import InvalidDelta
from serve.store.deltas.header import DELTA_MAGIC, HEADER_MAX, read_header

__all__ = [
    "DOMAIN",
    "SIGNATURE_REASONS",
    "DeltaSignatureError",
    "check_signature",
    "delta_message",
    "read_file_header",
    "sign_header",
]

#: The domain tag of a delta's signed message (:func:`serve.common.signing.signed_message`).
DOMAIN = "dlrm-delta/1"
#: The reasons a :class:`DeltaSignatureError` carries (bounded metric labels).
SIGNATURE_REASONS = ("unsigned", "bad_signature")


class DeltaSignatureError(InvalidDelta):
    """A delta refused by a pod that verifies signatures (400, field
    ``header.signature``): ``reason`` ``unsigned`` (no signature) or ``bad_signature``
    (malformed, another key, or fields changed after signing)."""

    kind = "DeltaSignatureError"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__("header.signature", message)
        self.reason = reason

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "reason": self.reason}


def delta_message(header: dict[str, Any]) -> bytes:
    """What a delta's signature signs (module docstring)."""
    return signed_message(DOMAIN, {k: header.get(k) for k in
                                   ("base_version", "sequence", "parent_digest", "sha256")})


def sign_header(header: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """``header`` (its ``sha256`` already set) with ``signature`` added."""
    if not isinstance(header.get("sha256"), str):
        raise InvalidDelta("header.sha256", "a delta is signed after its checksum is set")
    return {**header, "signature": key.sign(delta_message(header))}


def check_signature(header: dict[str, Any], key: VerifyKey) -> None:
    """The header's ``signature`` verifies under ``key``.

    Raises:
        DeltaSignatureError: ``unsigned`` (no ``signature``) or ``bad_signature``; the
            message says which delta, which key and what to do.
    """
    what = f"delta {header.get('sequence')!r} of version {str(header.get('base_version'))[:80]!r}"
    sig = header.get("signature")
    if sig is None:
        raise DeltaSignatureError(
            "unsigned", f"{what} is not signed, and this pod verifies deltas with the key "
                        f"{key.key_id} (--delta-verify-key {key.path}); build it with "
                        f"`python -m serve.model.delta --sign-key FILE` (make delta "
                        f"SIGN_KEY=FILE) using the private key of that pair")
    try:
        key.verify(delta_message(header), sig)
    except BadSignature as e:
        raise DeltaSignatureError(
            "bad_signature", f"{what}: the signature {e.why}; rebuild and sign it with the "
                             f"private key whose public key this pod holds") from None


def read_file_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of the delta file ``path``, reading only its first bytes (magic,
    length, at most :data:`~serve.store.deltas.header.HEADER_MAX` of JSON).

    Raises:
        InvalidDelta: no magic, a bad header, or a size that does not match it.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(len(DELTA_MAGIC) + 4 + HEADER_MAX)
    return read_header(memoryview(head), total)[0]
