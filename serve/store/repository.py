"""The model repository: immutable model versions, each an archive and its build report.

Layout of one repository folder (``model_store/`` locally; in Kubernetes the image's baked
folder plus a volume)::

    dlrm-small-int8-s0.mar     the archive of version ``small-int8-s0`` (read-only, 0444)
    dlrm-small-int8-s0.tables/ its embedding tables, one raw file per table
                               (:mod:`serve.store.tablefiles`): the archive's artifact
                               references them; they are mapped in place, never copied
    dlrm-small-int8-s0.mar.sha256  the archive's sha256 as the build recorded it
                               (``sha256sum`` format; the sidecar registers an archive
                               only when it matches: :meth:`ModelRepository.check_archive`)
    dlrm-small-int8-s0.json    its build report (written last: a version without its
                               report is incomplete and not listed)

The tables folder is moved in first, then the archive (a few MB: handler, config, dense
part), then the report: disk per version is its table bytes plus the archive. A version is
removed in the reverse order (:meth:`ModelRepository.remove`: report, archive, tables), so
a half-removed version is never listed. The workers find a version's tables folder in the
same folders, in the same order (``DLRM_REPOSITORY``); :meth:`ModelRepository.check_tables`
is the sidecar's check, before a switch, that they will (:func:`table_reference` reads the
archive's reference without torch).

**Archive digests.** An archive is code (its handler and model config run in the
workers), so :meth:`ModelRepository.add` records its sha256 beside it, before the report,
and :meth:`ModelRepository.check_tables` (what PUT /state and every switch run before
TorchServe loads a version) refuses a version whose recorded digest is missing or does
not match its archive (:meth:`ModelRepository.check_archive`). The digest alone tells an
archive changed after its build (a damaged copy, a swapped file), not who built it:
whoever can write the repository can write both. So the model publisher may sign it
(:func:`sign_archive_digest`, ``python -m serve.ops.keys sign-archives``:
``dlrm-<V>.mar.sha256.sig``, an ed25519 signature over the version, the archive's name
and its sha256), and a repository given a ``verify_key`` (the sidecar's
``--archive-verify-key``) refuses a version whose digest is unsigned or wrongly signed.
Versions added before digests existed have none: :func:`record_archive_digest` records
the digest of an archive an operator trusts (``python -m serve.ops.keys index-archives``).

A version is written once (:meth:`ModelRepository.add`) and never changed; its name
matches :data:`serve.state.VERSION_RE`. Archives the sidecar derives for serving (other
batching) are named ``dlrm-<version>_b..d..w...mar`` and are never listed as versions.

Example::

    repo = ModelRepository([Path("model_store")])
    repo.versions()            # ['small-int8-s0', 'small-int8-s7'], oldest first
    repo.archive("small-int8-s7")
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.common.signing import BadSignature, SigningKey, VerifyKey, signed_message
from serve.constants import ARTIFACT_NAME
from serve.errors import ArtifactError, ConfigError
from serve.profiles import get_profile
from serve.state import VERSION_RE
from serve.store.tablefiles import MANIFEST_NAME, TABLES_SUFFIX, TableFiles, TableManifest

__all__ = [
    "ARCHIVE_SIGNATURE_DOMAIN",
    "DEFAULT_DTYPE",
    "DEFAULT_PROFILE",
    "DIGEST_SUFFIX",
    "MANAGED_SUFFIX",
    "SHUFFLED_SUFFIX",
    "SIGNATURE_SUFFIX",
    "TABLES_REF_NAME",
    "ModelRepository",
    "TableReference",
    "day_suffix",
    "default_version",
    "dense_suffix",
    "extract_artifact",
    "file_digest",
    "record_archive_digest",
    "sign_archive_digest",
    "table_reference",
]

_VERSION = re.compile(VERSION_RE)

#: The suffix of a version trained on permuted labels (``make model LABEL_SHUFFLE=1``).
SHUFFLED_SUFFIX = "-shuffled"
#: What a build with ``--mapping managed`` (serve.runtime.idmap) adds to its version name.
MANAGED_SUFFIX = "-managed"
#: The profile ``make model`` builds without ``PROFILE=`` (and ``make up`` declares).
DEFAULT_PROFILE = "small"
#: The table dtype ``make model`` builds without ``--dtype``.
DEFAULT_DTYPE = "int8"
#: What an archive's recorded digest file adds to its name (``dlrm-<version>.mar.sha256``).
DIGEST_SUFFIX = ".sha256"
#: What a signed digest adds to the digest file's name (``dlrm-<version>.mar.sha256.sig``).
SIGNATURE_SUFFIX = ".sig"
#: The domain tag of an archive digest's signed message.
ARCHIVE_SIGNATURE_DOMAIN = "dlrm-archive/1"
_DIGEST_LINE = re.compile(r"([0-9a-f]{64})  (\S+)\n?")


def dense_suffix(dense_precision: str) -> str:
    """``-dense-bf16`` for a build whose dense part runs in a lossy precision, "" for fp32."""
    return "" if dense_precision == "fp32" else f"-dense-{dense_precision}"


def day_suffix(data_day: int) -> str:
    """``-day<N>`` for a build on day N's data (N > 0), else ``""``."""
    return f"-day{data_day}" if data_day > 0 else ""


def default_version(profile_name: str, dtype: str = DEFAULT_DTYPE, seed: int | None = None,
                    label_shuffle: bool = False, data_day: int = 0,
                    mapping: str = "modulo", dense_precision: str = "fp32") -> str:
    """The version a build gets without ``--version``: ``small-int8-s0``, or
    ``small-int8-s8-shuffled`` for a build with ``--label-shuffle``, ``small-int8-s0-day1``
    for one on day 1's data, ``small-int8-s0-managed`` for ``--mapping managed``,
    ``small-int8-s0-dense-bf16`` for ``--dense-precision bf16``. ``seed`` None: the profile's own (what ``make model`` trains
    without ``SEED=``). It lives with the repository, not the build, so that ``make up``
    names the version ``make model`` builds without importing the build.

    Raises:
        UnknownProfileError: ``seed`` is None and the profile does not exist.
    """
    if seed is None:
        seed = get_profile(profile_name).seed
    return (f"{profile_name}-{dtype}-s{seed}{SHUFFLED_SUFFIX if label_shuffle else ''}"
            f"{day_suffix(data_day)}{MANAGED_SUFFIX if mapping == 'managed' else ''}"
            f"{dense_suffix(dense_precision)}")


# --------------------------------------------------------------------------- the reference
# The sidecar reads which tables folder a version's artifact references without torch (the
# pod's sidecar never imports it): the archive carries it as a small JSON member,
# ``tables.json`` (serve.model.archive.build_mar writes it beside the artifact).

#: The archive member naming the tables folder its artifact references (``{"ref",
#: "identity", "bytes"}``, JSON).
TABLES_REF_NAME = "tables.json"


@dataclass(frozen=True)
class TableReference:
    """What a format-3 archive says about its tables: the folder's name
    (``<model>-<version>.tables`` of the version it was built as) and the identity of
    the build it was made with (:meth:`serve.store.tablefiles.TableManifest.identity`)."""

    folder: str
    identity: str


def table_reference(mar: str | os.PathLike[str]) -> TableReference | None:
    """The tables folder a model archive's artifact references (format 3), read without
    torch and without reading a table byte; None when the archive holds its tables
    (format 1 or 2) or is no zip at all (not this check's to judge: copying or loading
    it fails, saying why).

    Raises:
        ConfigError: its ``tables.json`` is unreadable or names no tables folder.
    """
    try:
        with zipfile.ZipFile(mar) as z:
            if TABLES_REF_NAME not in z.namelist():
                return None
            ref = json.loads(z.read(TABLES_REF_NAME))
    except (OSError, zipfile.BadZipFile):
        return None
    except ValueError as e:
        raise ConfigError(f"archive {mar}: {TABLES_REF_NAME} is unreadable ({e}); rebuild "
                          "the version") from e
    folder = str(ref.get("ref", "")) if isinstance(ref, dict) else ""
    if not folder.endswith(TABLES_SUFFIX) or "/" in folder or folder.startswith("."):
        raise ConfigError(f"archive {mar}: {TABLES_REF_NAME} must name a plain "
                          f"*{TABLES_SUFFIX} folder, got {ref!r}")
    return TableReference(folder, str(ref.get("identity", "")))


class ModelRepository:
    """Versions found in one or more folders (earlier folders win on a name clash).

    Args:
        roots: folders to read; the first is where :meth:`add` writes.
        model_name: the archives' prefix (TorchServe's model name).
        verify_key: the public key archive digests must be signed with
            (:meth:`check_archive`); None: digests are checked, signatures are not.
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]], model_name: str = "dlrm",
                 verify_key: VerifyKey | None = None) -> None:
        if not roots:
            raise ConfigError("a model repository needs at least one folder")
        self.roots = [Path(r) for r in roots]
        self.model_name = model_name
        self.verify_key = verify_key

    def archive_name(self, version: str) -> str:
        return f"{self.model_name}-{version}.mar"

    def tables_name(self, version: str) -> str:
        """The tables folder's name (what a format-3 artifact's reference says)."""
        return f"{self.model_name}-{version}{TABLES_SUFFIX}"

    def tables(self, version: str) -> Path | None:
        """The tables folder ``version``'s archive references, in the first repository
        folder that holds it, in the order the workers search (``DLRM_REPOSITORY``); None
        when there is none (a version built before the folder existed holds its tables in
        its archive).

        Raises:
            ConfigError: ``version`` is not in the repository.
        """
        ref = table_reference(self.archive(version))
        return None if ref is None else self._locate(ref.folder)

    def _locate(self, folder: str) -> Path | None:
        return next((r / folder for r in self.roots if (r / folder).is_dir()), None)

    def table_bytes(self, version: str) -> int | None:
        """The bytes of ``version``'s tables (its manifest's ``nbytes``: rows x row
        bytes, no table byte read); None when it has no tables folder.

        Raises:
            ConfigError: ``version`` is not in the repository.
            ArtifactError: the folder's manifest is missing or unreadable.
        """
        m = self.manifest(version)
        return None if m is None else m.nbytes

    def manifest(self, version: str) -> TableManifest | None:
        """The manifest of ``version``'s tables folder (no table byte read); None when
        it has none.

        Raises:
            ConfigError: ``version`` is not in the repository.
            ArtifactError: the folder's manifest is missing or unreadable.
        """
        folder = self.tables(version)
        return None if folder is None else _read_manifest(folder)

    def check_archive(self, version: str) -> str:
        """The sha256 recorded for ``version``'s archive when it was added, checked
        against the archive's bytes now and, with :attr:`verify_key`, its signature
        (module docstring, Archive digests); returns it.

        Raises:
            ConfigError: not in the repository, no digest recorded, the archive's bytes
                differ from it, or (with a verify key) the digest is unsigned or wrongly
                signed (the message names the version, the rule and what to do).
        """
        mar = self.archive(version)
        want = _recorded_digest(mar)
        if want is None:
            raise ConfigError(
                f"model version {version!r}: archive digest: no sha256 is recorded for "
                f"{mar} ({mar.name}{DIGEST_SUFFIX} is missing), and an archive is registered "
                f"only when its bytes match the digest its build recorded. Rebuild the "
                f"version (make model / make import record it), copy its "
                f"{mar.name}{DIGEST_SUFFIX} along with it, or, for an archive you trust, "
                f"record it: python -m serve.ops.keys index-archives --repository "
                f"{mar.parent}")
        got = file_digest(mar)
        if got != want:
            raise ConfigError(
                f"model version {version!r}: archive digest: {mar} has sha256 {got}, but "
                f"its build recorded {want}: the archive was changed after it was built "
                f"(damaged or replaced) and is not registered. Copy the version again "
                f"from its build, or rebuild it")
        if self.verify_key is not None:
            _check_digest_signature(mar, version, want, self.verify_key)
        return want

    def check_tables(self, version: str) -> Path | None:
        """What a switch checks before TorchServe loads ``version``: its archive's
        recorded digest (:meth:`check_archive`); the tables folder its archive references
        (:func:`table_reference`) is in one of the repository's folders, complete
        (manifest, every file of its size) and of the build the archive was made with.
        Returns that folder (None: the archive holds its tables).

        Raises:
            ConfigError: not in the repository, its archive's digest is missing or
                differs, or its tables are missing, incomplete or another build's (the
                message names the folder, where it was looked for and what to do).
        """
        self.check_archive(version)
        mar = self.archive(version)
        ref = table_reference(mar)
        if ref is None:
            return None
        folder = self._locate(ref.folder)
        if folder is None:
            raise ConfigError(
                f"model version {version!r}: its archive {mar} references the tables folder "
                f"{ref.folder}, which is in none of the repository folders "
                f"({', '.join(map(str, self.roots))}); copy the version's {ref.folder}/ "
                "there beside its .mar (before its .json), or rebuild it")
        try:
            files = TableFiles.open(folder)
        except ArtifactError as e:
            raise ConfigError(f"model version {version!r}: {e.message}") from None
        try:
            identity = files.manifest.identity()
        finally:
            files.close()
        if ref.identity and identity != ref.identity:
            raise ConfigError(
                f"model version {version!r}: tables folder {folder} holds another build "
                f"(identity {identity}; the archive was made with {ref.identity}); the "
                "version's files are mixed up: copy them again from one build, or rebuild")
        return folder

    def _paths(self, root: Path, version: str) -> tuple[Path, Path]:
        return root / self.archive_name(version), root / f"{self.model_name}-{version}.json"

    def _find(self, version: str) -> tuple[Path, Path] | None:
        for root in self.roots:
            mar, report = self._paths(root, version)
            if mar.is_file() and report.is_file():
                return mar, report
        return None

    def exists(self, version: str) -> bool:
        return self._find(version) is not None

    def _require(self, version: str) -> tuple[Path, Path]:
        found = self._find(version)
        if found is None:
            raise ConfigError(
                f"model version {version!r} is not in the repository "
                f"({', '.join(map(str, self.roots))}); available: {self.versions() or 'none'}. "
                "Build it with `make model` (SEED=, VERSION=) or copy its .mar and .json there")
        return found

    def archive(self, version: str) -> Path:
        """The archive of ``version``; ``ConfigError`` lists the versions there are."""
        return self._require(version)[0]

    def report(self, version: str) -> dict[str, Any]:
        """The build report of ``version`` (see ``serve.model.pipeline.REPORT_KEYS``)."""
        return dict(json.loads(self._require(version)[1].read_text()))

    def versions(self) -> list[str]:
        """Complete versions, oldest first (report ``created_at``, then name)."""
        seen: dict[str, tuple[str, str]] = {}
        prefix, suffix = f"{self.model_name}-", ".json"
        for root in self.roots:
            if not root.is_dir():
                continue
            for report in root.glob(f"{prefix}*{suffix}"):
                version = report.name[len(prefix):-len(suffix)]
                if version in seen or not _VERSION.fullmatch(version):
                    continue
                if not (root / self.archive_name(version)).is_file():
                    continue
                try:
                    created = str(json.loads(report.read_text()).get("created_at", ""))
                except (OSError, ValueError):
                    continue  # a report being written or damaged: not a complete version
                seen[version] = (created, version)
        return [v for v, _ in sorted(seen.items(), key=lambda kv: kv[1])]

    def latest(self) -> str | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def add(self, version: str, archive: Path, report: dict[str, Any],
            tables: Path | None = None) -> Path:
        """Store a new version: its ``tables`` folder (moved in, not copied: build it on
        the repository's file system), then the archive, then the report last, all
        read-only. Without ``tables``, an archive that references a tables folder (format
        3; another repository's version being copied in) brings the folder beside it:
        hard-linked file by file (no byte copied; copied only across file systems).

        Raises ``ConfigError`` if the name is invalid or the version already exists:
        versions are immutable, so a rebuild must get a new name; or if the archive
        references a tables folder of another name, or one that is not beside it.
        """
        if not _VERSION.fullmatch(version):
            raise ConfigError(f"version {version!r} must match {VERSION_RE} "
                              "(letters, digits, '.', '-'; at most 64 characters)")
        if self.exists(version):
            raise ConfigError(f"version {version!r} already exists in {self.roots[0]} and "
                              "versions are immutable; pick another name (VERSION=...)")
        root = self.roots[0]
        root.mkdir(parents=True, exist_ok=True)
        mar, rep = self._paths(root, version)
        placed: Path | None = root / self.tables_name(version)
        if tables is not None and placed is not None:
            if tables.name != placed.name:
                raise ConfigError(f"tables folder {tables} must be named {placed.name} (the "
                                  "name the version's artifact references)")
            # a leftover of an add that failed before its report: not a version
            shutil.rmtree(placed, ignore_errors=True)
            for f in tables.iterdir():
                os.chmod(f, 0o444)
            shutil.move(os.fspath(tables), placed)
        else:
            placed = _link_referenced(Path(archive), root)
        try:
            # the digest after the archive, the report (what lists the version) last
            for path, write in ((mar, lambda t: shutil.copyfile(archive, t)),
                                (_digest_path(mar), lambda t: _write_digest(t, mar)),
                                (rep, lambda t: t.write_text(json.dumps(report, indent=2)))):
                tmp = path.with_name(f".{path.name}.tmp")
                write(tmp)
                os.chmod(tmp, 0o444)
                os.replace(tmp, path)
        except BaseException:
            if placed is not None:
                shutil.rmtree(placed, ignore_errors=True)
            raise
        return mar

    def remove(self, version: str) -> None:
        """Delete ``version`` from the repository folder that holds it: the report first
        (the version is no longer listed), then the archive, then its tables folder
        there (a version's folder in another repository folder is that folder's).

        Raises:
            ConfigError: ``version`` is not in the repository.
        """
        mar, report = self._require(version)
        report.unlink()
        mar.unlink(missing_ok=True)
        _digest_path(mar).unlink(missing_ok=True)
        _signature_path(mar).unlink(missing_ok=True)
        # its own folder; one it shares with the version it was copied from stays
        shutil.rmtree(mar.with_name(self.tables_name(version)), ignore_errors=True)


def extract_artifact(mar: str | os.PathLike[str], dest: str | os.PathLike[str],
                     roots: Sequence[str | os.PathLike[str]] | None = None) -> Path:
    """Extract a model archive's artifact to ``dest/artifact.pt`` for reading in process
    (benchmarks, offline checks), and, when it references a tables folder (format 3),
    link that folder beside it (a symlink: no table byte copied), so
    ``load_artifact(dest / "artifact.pt")`` finds it without ``DLRM_REPOSITORY``.

    Args:
        roots: where the tables folder may be (default: the archive's own folder).

    Returns:
        the extracted artifact's path.

    Raises:
        ConfigError: the archive has no artifact, or its tables folder is in none of
            ``roots``.
    """
    mar, dest = Path(mar), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / ARTIFACT_NAME
    with zipfile.ZipFile(mar) as z:
        try:
            info = z.getinfo(ARTIFACT_NAME)
        except KeyError:
            raise ConfigError(f"{mar} has no {ARTIFACT_NAME}: not a model version's "
                              "archive") from None
        with z.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    ref = table_reference(mar)
    if ref is not None:
        search = [Path(r) for r in (roots if roots is not None else [mar.parent])]
        found = next((r / ref.folder for r in search if (r / ref.folder).is_dir()), None)
        if found is None:
            raise ConfigError(f"{mar} references the tables folder {ref.folder}, which is in "
                              f"none of {[str(r) for r in search]}; copy it beside the archive")
        link = dest / ref.folder
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(found.resolve(), target_is_directory=True)
    return out


def _link_referenced(archive: Path, root: Path) -> Path | None:
    """The tables folder ``archive`` references, from beside it, linked into ``root``
    under its own name (written as ``<name>.tmp-<pid>``, then renamed: hard links, no
    table byte copied; a copy only across file systems); None when it references none or
    ``root`` holds it already (another version added from the same archive)."""
    ref = table_reference(archive)
    if ref is None:
        return None
    placed = root / ref.folder
    src = archive.parent / ref.folder
    if placed.is_dir() and (not src.is_dir() or src.resolve() == placed.resolve()
                            or _identity(placed) == _identity(src)):
        return None
    if not src.is_dir():
        raise ConfigError(f"archive {archive} references the tables folder {ref.folder}, "
                          f"which is not beside it ({src}); copy the folder there first")
    stage = placed.with_name(f"{placed.name}.tmp-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(placed, ignore_errors=True)   # a leftover of an add that failed
    stage.mkdir()
    try:
        for f in sorted(src.iterdir()):
            try:
                os.link(f, stage / f.name)
            except OSError:   # another file system: a copy is the only way
                shutil.copyfile(f, stage / f.name)
                os.chmod(stage / f.name, 0o444)
        os.replace(stage, placed)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return placed


def _read_manifest(folder: Path) -> TableManifest:
    """A tables folder's manifest (no table byte read).

    Raises:
        ArtifactError: it is missing, unreadable or malformed.
    """
    path = folder / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path} is unreadable ({e}): the version's tables are "
                            "damaged or half-copied; copy them again or rebuild") from None
    return TableManifest.from_dict(data, str(path))


def _identity(folder: Path) -> str | None:
    """The build a tables folder holds (None: no readable manifest)."""
    try:
        return _read_manifest(folder).identity()
    except ArtifactError:
        return None


def file_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _digest_path(mar: Path) -> Path:
    return mar.with_name(mar.name + DIGEST_SUFFIX)


def _signature_path(mar: Path) -> Path:
    return mar.with_name(mar.name + DIGEST_SUFFIX + SIGNATURE_SUFFIX)


def _write_digest(target: Path, mar: Path) -> None:
    """Write ``mar``'s digest line (``sha256sum`` format) to ``target``."""
    target.write_text(f"{file_digest(mar)}  {mar.name}\n")


def _recorded_digest(mar: Path) -> str | None:
    """The sha256 recorded beside ``mar``; None when there is no digest file.

    Raises:
        ConfigError: the file is unreadable or not one ``<sha256>  <archive name>`` line.
    """
    path = _digest_path(mar)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"archive digest {path}: cannot be read ({e})") from None
    m = _DIGEST_LINE.fullmatch(text)
    if m is None or m.group(2) != mar.name:
        raise ConfigError(f"archive digest {path} must be one line '<sha256>  {mar.name}' "
                          f"(sha256sum format); got {text[:120]!r}. Rebuild the version or "
                          "record the digest again")
    return m.group(1)


def record_archive_digest(repo: ModelRepository, version: str) -> tuple[Path, bool]:
    """Record the sha256 of ``version``'s archive as it is now, when none is recorded
    (versions added before digests existed): the digest file, and whether it was
    written (False: one was there already, left unchanged). Only for archives the
    operator trusts: it vouches for whatever bytes are there now.

    Raises:
        ConfigError: ``version`` is not in the repository.
    """
    mar = repo.archive(version)
    path = _digest_path(mar)
    if path.exists():
        return path, False
    tmp = path.with_name(f".{path.name}.tmp")
    _write_digest(tmp, mar)
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
    return path, True


def _archive_message(version: str, mar: Path, sha256: str) -> bytes:
    return signed_message(ARCHIVE_SIGNATURE_DOMAIN,
                          {"version": version, "archive": mar.name, "sha256": sha256})


def _check_digest_signature(mar: Path, version: str, sha256: str, key: VerifyKey) -> None:
    """The signature beside ``mar``'s digest verifies under ``key`` (module docstring)."""
    path = _signature_path(mar)
    try:
        signature = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"model version {version!r}: archive signature: {path.name} is missing, and "
            f"this sidecar registers only archives whose digest is signed with the key "
            f"{key.key_id} (--archive-verify-key {key.path}); sign it with that pair's "
            f"private key: python -m serve.ops.keys sign-archives --key FILE --repository "
            f"{mar.parent}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model version {version!r}: archive signature: {path} cannot be "
                          f"read as JSON ({e}); sign the digest again") from None
    try:
        key.verify(_archive_message(version, mar, sha256), signature)
    except BadSignature as e:
        raise ConfigError(f"model version {version!r}: archive signature: {path.name}: the "
                          f"signature {e.why}; the archive is not registered") from None


def sign_archive_digest(repo: ModelRepository, version: str, key: SigningKey) -> Path:
    """Sign ``version``'s recorded archive digest with ``key`` (after checking it against
    the archive's bytes): writes and returns ``dlrm-<version>.mar.sha256.sig``.

    Raises:
        ConfigError: not in the repository, or its digest is missing or differs.
    """
    sha256 = ModelRepository(repo.roots, repo.model_name).check_archive(version)
    mar = repo.archive(version)
    path = _signature_path(mar)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(key.sign(_archive_message(version, mar, sha256))) + "\n")
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)
    return path
