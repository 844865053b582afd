"""The model repository: immutable model versions, each an archive and its build report.

Layout of one repository folder (``model_store/`` locally; in Kubernetes the image's baked
folder plus a volume)::

    dlrm-small-int8-s0.mar     the archive of version ``small-int8-s0`` (read-only, 0444)
    dlrm-small-int8-s0.tables/ its embedding tables, one raw file per table
                               (:mod:`serve.store.tablefiles`): the archive's artifact
                               references them; they are mapped in place, never copied
    dlrm-small-int8-s0.json    its build report (written last: a version without its
                               report is incomplete and not listed)

The tables folder is moved in first, then the archive (a few MB: handler, config, dense
part), then the report: disk per version is its table bytes plus the archive.

A version is written once (:meth:`ModelRepository.add`) and never changed; its name
matches :data:`serve.state.VERSION_RE`. Archives the sidecar derives for serving (other
batching) are named ``dlrm-<version>_b..d..w...mar`` and are never listed as versions.

Example::

    repo = ModelRepository([Path("model_store")])
    repo.versions()            # ['small-int8-s0', 'small-int8-s7'], oldest first
    repo.archive("small-int8-s7")
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serve.errors import ConfigError
from serve.profiles import get_profile
from serve.state import VERSION_RE
from serve.store.tablefiles import TABLES_SUFFIX

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_PROFILE",
    "MANAGED_SUFFIX",
    "SHUFFLED_SUFFIX",
    "TABLES_REF_NAME",
    "ModelRepository",
    "day_suffix",
    "default_version",
    "dense_suffix",
]

_VERSION = re.compile(VERSION_RE)

#: The archive member naming the tables folder its artifact references (``{"ref",
#: "identity", "bytes"}``, JSON): read here without torch.
TABLES_REF_NAME = "tables.json"

#: The suffix of a version trained on permuted labels (``make model LABEL_SHUFFLE=1``).
SHUFFLED_SUFFIX = "-shuffled"
#: What a build with ``--mapping managed`` (serve.runtime.idmap) adds to its version name.
MANAGED_SUFFIX = "-managed"
#: The profile ``make model`` builds without ``PROFILE=`` (and ``make up`` declares).
DEFAULT_PROFILE = "small"
#: The table dtype ``make model`` builds without ``--dtype``.
DEFAULT_DTYPE = "int8"


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


class ModelRepository:
    """Versions found in one or more folders (earlier folders win on a name clash).

    Args:
        roots: folders to read; the first is where :meth:`add` writes.
        model_name: the archives' prefix (TorchServe's model name).
    """

    def __init__(self, roots: Sequence[str | os.PathLike[str]], model_name: str = "dlrm") -> None:
        if not roots:
            raise ConfigError("a model repository needs at least one folder")
        self.roots = [Path(r) for r in roots]
        self.model_name = model_name

    def archive_name(self, version: str) -> str:
        return f"{self.model_name}-{version}.mar"

    def tables_name(self, version: str) -> str:
        """The tables folder's name (what a format-3 artifact's reference says)."""
        return f"{self.model_name}-{version}{TABLES_SUFFIX}"

    def tables(self, version: str) -> Path | None:
        """The tables folder ``version``'s archive references (None: the archive holds
        its tables, as versions built before the folder existed do)."""
        mar = self.archive(version)
        ref = tables_ref(mar)
        return None if ref is None else mar.with_name(str(ref["ref"]))

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
        read-only.

        Raises ``ConfigError`` if the name is invalid or the version already exists:
        versions are immutable, so a rebuild must get a new name.
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
        placed = _place_tables(root, archive, tables)
        try:
            for path, write in ((mar, lambda t: shutil.copyfile(archive, t)),
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


def tables_ref(archive: Path) -> dict[str, Any] | None:
    """The archive's tables reference (:data:`TABLES_REF_NAME`), None when it has none
    (or is no zip at all: TorchServe is the judge of that)."""
    try:
        with zipfile.ZipFile(archive) as z:
            if TABLES_REF_NAME not in z.namelist():
                return None
            ref = json.loads(z.read(TABLES_REF_NAME))
    except zipfile.BadZipFile:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"archive {archive} is unreadable ({e}); rebuild the version") from e
    if not isinstance(ref, dict) or not str(ref.get("ref", "")).endswith(TABLES_SUFFIX):
        raise ConfigError(f"archive {archive}: {TABLES_REF_NAME} must name a "
                          f"*{TABLES_SUFFIX} folder, got {ref!r}")
    return ref


def _place_tables(root: Path, archive: Path, tables: Path | None) -> Path | None:
    """Put the tables folder ``archive`` references into ``root``; return it when this
    call placed it (None: no tables, or already there). ``tables`` is moved in (a build's
    fresh folder); without it, the folder beside ``archive`` is linked in file by file
    (hard links: no table byte copied; a copy across file systems)."""
    ref = tables_ref(archive)
    if ref is None:
        if tables is not None:
            raise ConfigError(f"archive {archive} references no tables folder, but "
                              f"{tables} was given")
        return None
    dst = root / str(ref["ref"])
    src = tables if tables is not None else archive.parent / str(ref["ref"])
    if src.resolve() == dst.resolve():
        return None
    if tables is None and dst.is_dir():
        return None        # another version's archive referencing the same tables
    if not src.is_dir():
        raise ConfigError(f"archive {archive} references tables folder {src.name}, which "
                          f"is not beside it ({src.parent}); copy the version with it")
    shutil.rmtree(dst, ignore_errors=True)   # a leftover of an add that failed
    if tables is not None:
        for f in tables.iterdir():
            os.chmod(f, 0o444)
        shutil.move(os.fspath(tables), dst)
        return dst
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    os.replace(tmp, dst)
    return dst
