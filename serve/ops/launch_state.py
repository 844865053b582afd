"""The desired state ``make up`` serves: declared once from the version ``make model``
builds (its report's batching and workers), then left alone across restarts."""
from __future__ import annotations

from pathlib import Path

from serve.common.validate import is_int
from serve.errors import ConfigError
from serve.ops.launch_config import show_path
from serve.state import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_BATCH_DELAY_MS,
    DEFAULT_WORKERS,
    Batching,
    DesiredState,
    ModelRef,
    load_state,
    write_state,
)
from serve.store.repository import ModelRepository

__all__ = ["default_state", "describe_state", "ensure_state", "served_version"]


def default_state(repo: ModelRepository, version: str) -> DesiredState:
    """The state ``make up`` declares first: ``version`` (the one ``make model`` builds with
    the same arguments, :func:`serve.store.repository.default_version`; never simply the
    newest file, which may be a shuffled-label experiment), with its ``.mar``'s batching.

    Batching and workers come from the version's report (``mar_batch_size``,
    ``mar_max_batch_delay_ms``, ``mar_workers``), else the shipped defaults
    (:data:`serve.state.DEFAULT_BATCH_SIZE` and the two beside it).

    Raises:
        ConfigError: ``version`` is not in the repository (the message lists what is).
    """
    if not repo.exists(version):
        where = ", ".join(f"{show_path(r)}/" for r in repo.roots)
        have = repo.versions()
        hint = (f"available: {', '.join(have)}; serve one of them with `make up VERSION=<name>`"
                if have else "the repository is empty")
        raise ConfigError(f"model version {version!r} is not in {where} ({hint}); "
                          f"build it with `make model` (same PROFILE/SEED/VERSION)")
    report = repo.report(version)

    def pick(key: str, fallback: int) -> int:
        value = report.get(key)
        return value if is_int(value) else fallback

    return DesiredState(
        model=ModelRef(version=version),
        batching=Batching(batch_size=pick("mar_batch_size", DEFAULT_BATCH_SIZE),
                          max_batch_delay_ms=pick("mar_max_batch_delay_ms", DEFAULT_MAX_BATCH_DELAY_MS)),
        workers=pick("mar_workers", DEFAULT_WORKERS))


def ensure_state(path: Path, repo: ModelRepository, version: str) -> tuple[DesiredState, bool]:
    """Read the desired-state file, creating it with :func:`default_state` (declaring
    ``version``) if absent.

    An existing file is never rewritten (``make down && make up`` serves the same state),
    but it is validated, and the version it names must be in the repository: the sidecar
    could never converge otherwise. Returns (state, created).
    """
    if path.exists():
        return _existing_state(path, repo, version), False
    state = default_state(repo, version)
    write_state(path, state)
    return state, True


def _existing_state(path: Path, repo: ModelRepository, version: str) -> DesiredState:
    state = load_state(path)
    if not repo.exists(state.model.version):
        raise ConfigError(
            f"{show_path(path)} declares model version {state.model.version!r}, which is not in "
            f"the repository ({', '.join(map(show_path, repo.roots))}); available: "
            f"{', '.join(repo.versions()) or 'none'}. Build it (`make model VERSION=...`), "
            f"edit model.version in {show_path(path)}, or delete the file to declare "
            f"{version!r}")
    return state


def served_version(path: Path, repo: ModelRepository, version: str) -> str:
    """The model version ``make up`` would serve, without writing anything: the one the
    desired-state file ``path`` declares when it exists (``make up`` never rewrites it),
    else ``version`` (what ``make model`` builds; never simply the newest file of the
    repository, which may be an import of another request schema or a shuffled-label
    experiment). For the tools that start a service of their own (``make faults``, the
    benchmarks).

    Raises:
        ConfigError: that version is not in ``repo`` (the message says what is).
    """
    if path.exists():
        return _existing_state(path, repo, version).model.version
    return default_state(repo, version).model.version


def describe_state(state: DesiredState) -> str:
    """``version small-int8-s0, batch_size 2, max_batch_delay 2 ms, 2 workers``."""
    b = state.batching
    return (f"version {state.model.version}, batch_size {b.batch_size}, max_batch_delay "
            f"{b.max_batch_delay_ms} ms, {state.workers} worker{'s' if state.workers != 1 else ''}")
