"""Ed25519 keys and signatures for what a publisher hands the pods (embedding deltas).

A *publisher* (``python -m serve.model.delta --sign-key FILE``) holds the private key; the
pods hold only the public key (``--delta-verify-key FILE``, in Kubernetes a ConfigMap), so
a pod, or whoever can write the volume the deltas come from, cannot make a delta the
other pods take. Keys are PEM files (PKCS#8 private key, SubjectPublicKeyInfo public
key), the format ``openssl genpkey -algorithm ed25519`` writes too; ``python -m
serve.ops.keys generate --out DIR`` writes a pair.

A signature signs a *message* built by its caller (:func:`signed_message`: a domain tag,
then canonical JSON of the fields it covers), never raw file bytes, so a signature made
for one kind of object can never pass as another's.

Example::

    private, public = generate_keypair()
    sig = sign(private, signed_message("dlrm-delta/1", {"sha256": "ab..."}))
    verify(public, signed_message("dlrm-delta/1", {"sha256": "ab..."}), sig)  # or raises
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

# cryptography is imported where a key is used, not here: modules that only name these
# types (the delta format, the repository, which the TorchServe workers import) must not
# load it.

__all__ = [
    "ALGORITHM",
    "BadSignature",
    "SigningKey",
    "VerifyKey",
    "generate_keypair",
    "key_id",
    "load_signing_key",
    "load_verify_key",
    "private_pem",
    "public_pem",
    "signed_message",
]

#: The only signature algorithm written and read.
ALGORITHM = "ed25519"


class BadSignature(Exception):
    """A signature that does not verify under the key (or is malformed): ``why`` says
    which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def signed_message(domain: str, fields: dict[str, Any]) -> bytes:
    """The bytes a signature covers: ``domain`` (what kind of object, e.g.
    ``dlrm-delta/1``), a newline, then ``fields`` as canonical JSON (sorted keys, no
    spaces), UTF-8."""
    return domain.encode() + b"\n" + json.dumps(fields, sort_keys=True,
                                                separators=(",", ":")).encode()


def key_id(public: Ed25519PublicKey) -> str:
    """A short name of a public key: the first 16 hex digits of the sha256 of its 32 raw
    bytes. Written beside a signature so an operator sees which key made it."""
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    """A private key loaded from ``path`` (:func:`load_signing_key`)."""

    key: Ed25519PrivateKey
    path: Path

    @property
    def key_id(self) -> str:
        return key_id(self.key.public_key())

    def sign(self, message: bytes) -> dict[str, str]:
        """The signature of ``message`` as the JSON object a header carries:
        ``{"alg": "ed25519", "key_id": <hex16>, "value": <base64 of 64 bytes>}``."""
        return {"alg": ALGORITHM, "key_id": self.key_id,
                "value": base64.b64encode(self.key.sign(message)).decode()}


@dataclass(frozen=True)
class VerifyKey:
    """A public key loaded from ``path`` (:func:`load_verify_key`)."""

    key: Ed25519PublicKey
    path: Path

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    def verify(self, message: bytes, signature: Any) -> None:
        """Check ``signature`` (the JSON object :meth:`SigningKey.sign` returns) over
        ``message``.

        Raises:
            BadSignature: not such an object, another algorithm, not base64 of 64 bytes,
                or it does not verify under this key (``why`` names the key's id and the
                signature's).
        """
        if not isinstance(signature, dict):
            raise BadSignature(f"must be an object with alg, key_id and value; got "
                               f"{type(signature).__name__}")
        if signature.get("alg") != ALGORITHM:
            raise BadSignature(f"alg {str(signature.get('alg'))[:40]!r} is not {ALGORITHM!r}, "
                               "the only algorithm this service verifies")
        value = signature.get("value")
        try:
            raw = base64.b64decode(value if isinstance(value, str) else "", validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != 64:
            raise BadSignature("value must be the base64 of a 64-byte ed25519 signature")
        from cryptography.exceptions import InvalidSignature

        try:
            self.key.verify(raw, message)
        except InvalidSignature:
            raise BadSignature(
                f"does not verify under the verify key {self.key_id} ({self.path}); the "
                f"signature names key {str(signature.get('key_id'))[:40]!r}: it was made "
                f"with another key, or the signed fields were changed after signing"
            ) from None


def generate_keypair() -> tuple[Ed25519PrivateKey, Ed25519PublicKey]:
    """A new random ed25519 key pair."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    return private, private.public_key()


def private_pem(private: Ed25519PrivateKey) -> bytes:
    """``private`` as an unencrypted PKCS#8 PEM (keep the file mode 0600)."""
    from cryptography.hazmat.primitives import serialization

    return private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())


def public_pem(public: Ed25519PublicKey) -> bytes:
    """``public`` as a SubjectPublicKeyInfo PEM."""
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot be read ({e.strerror or e}); pass the "
                          "PEM file `python -m serve.ops.keys generate` wrote") from None


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """The ed25519 private key in the PEM file ``path``, which only its owner may read.

    Raises:
        ConfigError: the file is readable by its group or others (mode & 0o077: run
            ``chmod 600``), unreadable, or not an unencrypted ed25519 private key PEM.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path)
    try:
        mode = stat.S_IMODE(p.stat().st_mode)
    except OSError as e:
        raise ConfigError(f"signing key {p}: {e.strerror or e}; pass the private key file "
                          "`python -m serve.ops.keys generate --out DIR` wrote") from None
    if mode & 0o077:
        raise ConfigError(f"signing key {p} has mode {mode:04o}: a private key must be "
                          f"readable by its owner only (mode 0600 or 0400); run "
                          f"`chmod 600 {p}`")
    try:
        key = serialization.load_pem_private_key(_read(p, "signing key"), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"signing key {p} is not an unencrypted PEM private key ({e}); "
                          "generate one with `python -m serve.ops.keys generate`") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {p} is a {type(key).__name__}, not an ed25519 key; "
                          "generate one with `python -m serve.ops.keys generate`")
    return SigningKey(key, p)


def load_verify_key(path: str | os.PathLike[str]) -> VerifyKey:
    """The ed25519 public key in the PEM file ``path``.

    Raises:
        ConfigError: unreadable, or not an ed25519 public key PEM (a private key file is
            refused too: the pods must never hold it).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    p = Path(path)
    data = _read(p, "verify key")
    if b"PRIVATE KEY" in data:
        raise ConfigError(f"verify key {p} holds a private key: the pods verify with the "
                          "public key only (the .pub file `python -m serve.ops.keys "
                          "generate` wrote); keep the private key with the publisher")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"verify key {p} is not a PEM public key ({e}); pass the .pub "
                          "file `python -m serve.ops.keys generate` wrote") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"verify key {p} is a {type(key).__name__}, not an ed25519 key")
    return VerifyKey(key, p)
