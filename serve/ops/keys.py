"""Signing keys for embedding deltas (generate a pair, sign a delta file, verify one),
and the archive digests of a model repository.

    python -m serve.ops.keys generate --out keys/          # delta-signing.key (0600) + .pub
    python -m serve.ops.keys verify --key keys/delta-signing.pub FILE.delta...
    python -m serve.ops.keys sign --key keys/delta-signing.key FILE.delta
    python -m serve.ops.keys index-archives --repository model_store   # record missing digests
    python -m serve.ops.keys generate --out keys/ --name model-signing   # the archives' pair
    python -m serve.ops.keys sign-archives --key keys/model-signing.key --repository model_store

The private key stays with the delta publisher (``make delta SIGN_KEY=...``); the public
key goes to every pod (``--delta-verify-key``; in Kubernetes the ConfigMap
``dlrm-delta-verify-key``, docs/deltas.md, "Signed deltas").

``sign`` adds a signature to a delta written unsigned. It changes the file's bytes, so
its digest: do it before the next delta of the chain is built (that one names this file's
digest as its parent), else build with ``--sign-key`` from the start.

``index-archives`` records the sha256 of every version's archive that has none
(``dlrm-<version>.mar.sha256``; versions added before digests existed): the sidecar
registers an archive only when it matches its recorded digest
(:meth:`serve.store.repository.ModelRepository.check_archive`). It vouches for the bytes
there now: run it only on archives you built or trust. ``sign-archives`` signs each
version's recorded digest (after checking it against the archive), which sidecars
started with ``--archive-verify-key`` require; use a pair of its own (``generate --out
DIR`` in another folder): the model publisher's key, not the delta publisher's.
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

from serve.common.signing import (
    generate_keypair,
    key_id,
    load_signing_key,
    load_verify_key,
    private_pem,
    public_pem,
)
from serve.errors import ServeError
from serve.store.deltas.header import DELTA_MAGIC, canonical_json, read_header
from serve.store.deltas.signature import check_signature, read_file_header, sign_header
from serve.store.repository import (
    ModelRepository,
    record_archive_digest,
    sign_archive_digest,
)

__all__ = ["KEY_NAME", "PUB_NAME", "generate", "main", "sign_file"]

#: The file names ``generate`` writes in ``--out``.
KEY_NAME = "delta-signing.key"
PUB_NAME = "delta-signing.pub"


def generate(out: Path, force: bool = False, name: str = "delta-signing") -> tuple[Path, Path]:
    """Write a new ed25519 pair in ``out``: ``<name>.key`` (:data:`KEY_NAME` by default;
    mode 0600, created with O_EXCL so it is never readable by others, not even briefly)
    and ``<name>.pub`` (0644). Refuses to overwrite unless ``force``.

    Raises:
        FileExistsError: a key file is there already (and not ``force``).
    """
    out.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = out / f"{name}.key", out / f"{name}.pub"
    if force:
        key_path.unlink(missing_ok=True)
    elif key_path.exists() or pub_path.exists():
        raise FileExistsError(f"{key_path} or {pub_path} exists; pass --force to replace "
                              "the pair (every pod must then get the new public key)")
    private, public = generate_keypair()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem(private))
    os.chmod(key_path, 0o600)
    pub_path.write_bytes(public_pem(public))
    os.chmod(pub_path, 0o644)
    return key_path, pub_path


def sign_file(path: Path, key_file: Path) -> str:
    """Rewrite the delta file ``path`` with a signature in its header (atomically); the
    signing key's id. The checksum must already be right (it is what is signed)."""
    key = load_signing_key(key_file)
    data = path.read_bytes()
    header, off = read_header(memoryview(data), len(data))
    head = canonical_json(sign_header({k: v for k, v in header.items() if k != "signature"},
                                      key))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(DELTA_MAGIC + struct.pack("<I", len(head)) + head + data[off:])
    os.replace(tmp, path)
    return key.key_id


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.ops.keys",
        description="Ed25519 keys that sign embedding deltas (and, optionally, model "
                    "archives' digests): the publisher signs with the private key, every "
                    "pod verifies with the public key (--delta-verify-key, "
                    "--archive-verify-key) and refuses what is unsigned or wrongly signed. "
                    "Also records the archive digests of versions added before digests "
                    "existed (index-archives).")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help=f"write a new pair: {KEY_NAME} (0600) and "
                                          f"{PUB_NAME} in --out")
    gen.add_argument("--out", required=True, type=Path, help="folder for the two files")
    gen.add_argument("--force", action="store_true", help="replace an existing pair")
    gen.add_argument("--name", default="delta-signing",
                     help="the files' stem (default delta-signing; e.g. model-signing for "
                          "the archives' pair: another publisher, another key)")
    sign = sub.add_parser("sign", help="add a signature to delta files written unsigned "
                                       "(before the next delta of the chain is built)")
    sign.add_argument("--key", required=True, type=Path, help="the private key (mode 0600)")
    sign.add_argument("files", nargs="+", type=Path)
    ver = sub.add_parser("verify", help="check delta files' signatures (exit 1 if any fails)")
    ver.add_argument("--key", required=True, type=Path, help="the public key")
    ver.add_argument("files", nargs="+", type=Path)
    idx = sub.add_parser("index-archives", help="record the sha256 of each version's archive "
                                                "that has none (only archives you trust)")
    idx.add_argument("--repository", required=True, type=Path, help="the model repository")
    idx.add_argument("--model-name", default="dlrm", help="model name (default dlrm)")
    sar = sub.add_parser("sign-archives", help="sign each version's recorded archive digest "
                                               "(for --archive-verify-key)")
    sar.add_argument("--key", required=True, type=Path, help="the private key (mode 0600)")
    sar.add_argument("--repository", required=True, type=Path, help="the model repository")
    sar.add_argument("--model-name", default="dlrm", help="model name (default dlrm)")
    sar.add_argument("versions", nargs="*", help="the versions to sign (default: all)")
    return ap


def _sign_archives(key_file: Path, repository: Path, model_name: str,
                   versions: list[str]) -> int:
    key = load_signing_key(key_file)
    repo = ModelRepository([repository], model_name)
    for version in versions or repo.versions():
        print(f"{version}: signed by key {key.key_id} in "
              f"{sign_archive_digest(repo, version, key)}")
    return 0


def _index(repository: Path, model_name: str) -> int:
    repo = ModelRepository([repository], model_name)
    for version in repo.versions():
        path, wrote = record_archive_digest(repo, version)
        print(f"{version}: {'recorded' if wrote else 'already recorded'} in {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            key_path, pub_path = generate(args.out, args.force, args.name)
            print(f"wrote {key_path} (private, 0600: keep it with the delta publisher) and "
                  f"{pub_path} (public: --delta-verify-key of every pod); key id "
                  f"{load_verify_key(pub_path).key_id}")
            return 0
        if args.command == "sign-archives":
            return _sign_archives(args.key, args.repository, args.model_name, args.versions)
        if args.command == "index-archives":
            return _index(args.repository, args.model_name)
        if args.command == "sign":
            for f in args.files:
                print(f"{f}: signed by key {sign_file(f, args.key)}")
            return 0
        key = load_verify_key(args.key)
        failed = 0
        for f in args.files:
            try:
                check_signature(read_file_header(f), key)
                print(f"{f}: signature verifies under key {key_id(key.key)}")
            except ServeError as e:
                failed += 1
                print(f"{f}: {e.message}", file=sys.stderr)
        return 1 if failed else 0
    except (ServeError, OSError) as e:
        print(f"error: {getattr(e, 'message', e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
