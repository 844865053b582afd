"""The fleet's records and their local stores (:mod:`serve.sidecar.control.fleet` says
how they are used): a :class:`RolloutDecision`, the :class:`DecisionStore` and
:class:`Lease` contracts, their file implementations (``fcntl.flock``; one machine only,
``make fleet``), and the fleet's pods (:class:`Peer`, ``.run/fleet.json``).

Adapters, so the Kubernetes ones (:mod:`serve.sidecar.adapters.kubernetes`) share the
records without importing the control layer.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from serve.common.durable import write_durably
from serve.errors import ConfigError

__all__ = [
    "DECISION_PHASES",
    "KEEP_DECISIONS",
    "DecisionStore",
    "FileDecisionStore",
    "FileLease",
    "FilePeers",
    "Lease",
    "Peer",
    "PeerSource",
    "RolloutDecision",
    "StaticPeers",
    "decision_revision",
    "decisions_of",
    "read_fleet_file",
    "with_decision",
    "write_fleet_file",
]

_log = logging.getLogger(__name__)

#: The phases a decision records.
DECISION_PHASES = ("promoted", "rolled_back")
#: Decisions a store keeps (the oldest go first): one per declared rollout, so 32 covers
#: any rollout still declared.
KEEP_DECISIONS = 32


def decision_revision(key: str, phase: str, decided_at: float, decided_by: str) -> str:
    """``<key>-<8 hex>``: the same on every pod for one decision (it is recorded once and
    read by all)."""
    text = f"{phase}|{decided_at!r}|{decided_by}"
    return f"{key}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class RolloutDecision:
    """The outcome of one declared rollout, as recorded for the fleet.

    Attributes:
        key: :func:`serve.sidecar.control.rollout.rollout_key` of (stable, spec).
        stable, candidate: the versions.
        phase: ``promoted`` or ``rolled_back``.
        reason: why (the breached guards, the bake that held, or the POST's reason).
        revision: :func:`decision_revision`; identifies this decision on every pod.
        decided_by: the pod (or controller) that decided.
        decided_at: unix seconds.
    """

    key: str
    stable: str
    candidate: str
    phase: str
    reason: str
    revision: str
    decided_by: str
    decided_at: float

    def __post_init__(self) -> None:
        if self.phase not in DECISION_PHASES:
            raise ValueError(f"decision phase {self.phase!r} must be one of {DECISION_PHASES}")
        for name in ("key", "stable", "candidate", "revision", "decided_by"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"decision {name} must be a non-empty string, "
                                 f"got {getattr(self, name)!r}")

    @classmethod
    def make(cls, *, key: str, stable: str, candidate: str, phase: str, reason: str,
             decided_by: str, decided_at: float) -> RolloutDecision:
        """A decision with its revision computed."""
        return cls(key=key, stable=stable, candidate=candidate, phase=phase, reason=reason,
                   revision=decision_revision(key, phase, decided_at, decided_by),
                   decided_by=decided_by, decided_at=decided_at)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RolloutDecision:
        """Raises ValueError for anything but a decision's JSON object."""
        if not isinstance(data, dict):
            raise ValueError(  # noqa: TRY004 - one error type for a bad record
                f"a rollout decision is a JSON object, got {type(data).__name__}")
        try:
            return cls(key=data["key"], stable=data["stable"], candidate=data["candidate"],
                       phase=data["phase"], reason=str(data.get("reason") or ""),
                       revision=data["revision"], decided_by=data["decided_by"],
                       decided_at=float(data["decided_at"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a rollout decision lacks or mistypes {e}") from None


class DecisionStore(Protocol):
    """Where the fleet's decisions are recorded."""

    def read(self, key: str) -> RolloutDecision | None:
        """The decision recorded for rollout ``key``; None when there is none."""
        ...

    def record(self, decision: RolloutDecision) -> RolloutDecision:
        """Record ``decision`` unless one exists for its key; return the one that holds
        (first writer wins: the existing one, unchanged)."""
        ...


class Lease(Protocol):
    """Leadership: one holder at a time, lost without renewal."""

    def try_acquire(self, identity: str) -> bool:
        """Acquire (free or expired) or renew (held by ``identity``); True when
        ``identity`` holds it now."""
        ...

    def holder(self) -> str | None:
        """Who holds it now (None: nobody, or it expired). A read."""
        ...


def decisions_of(data: Any) -> list[RolloutDecision]:
    """The decisions of a store's JSON (``{"decisions": [...]}``), oldest first; entries
    that do not parse are dropped (and logged)."""
    out = []
    items = data.get("decisions", []) if isinstance(data, dict) else []
    for item in items if isinstance(items, list) else []:
        try:
            out.append(RolloutDecision.from_json(item))
        except ValueError as e:
            _log.warning("skipping a rollout decision that does not parse: %s", e)
    return out


def with_decision(existing: list[RolloutDecision], decision: RolloutDecision,
                  keep: int = KEEP_DECISIONS) -> tuple[list[RolloutDecision], RolloutDecision]:
    """(the decisions to store, the one that holds for ``decision.key``): first writer
    wins; the newest ``keep`` are kept."""
    for d in existing:
        if d.key == decision.key:
            return existing, d
    return [*existing, decision][-keep:], decision


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` (the data file is replaced on write, so
    its own inode cannot carry the lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.warning("%s does not read as JSON (%s); treating it as empty", path, e)
        return None


class FileDecisionStore:
    """Decisions in one JSON file (``{"decisions": [...]}``, the newest 32), changed under
    ``flock`` and written durably (:func:`serve.common.durable.write_durably`).

    Args:
        path: the file (locally ``.run/rollout-decisions.json``, next to the state file).
        keep: decisions kept.
    """

    def __init__(self, path: Path, keep: int = KEEP_DECISIONS) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep} must be >= 1 decision")
        self.path = Path(path)
        self.keep = keep

    def read(self, key: str) -> RolloutDecision | None:
        for d in decisions_of(_read_json(self.path)):
            if d.key == key:
                return d
        return None

    def record(self, decision: RolloutDecision) -> RolloutDecision:
        with _locked(self.path):
            existing = decisions_of(_read_json(self.path))
            kept, holds = with_decision(existing, decision, self.keep)
            if holds is decision:
                body = {"decisions": [d.to_json() for d in kept]}
                write_durably(self.path, (json.dumps(body, indent=1) + "\n").encode())
                _log.info("recorded rollout decision %s: %s (%s)", decision.revision,
                          decision.phase, decision.decided_by)
            return holds


class FileLease:
    """A lease in a JSON file, ``{holder, renewed_at, duration_s, transitions}``, changed
    under ``flock``.

    Args:
        path: the file (locally ``.run/rollout-lease.json``).
        duration_s: it expires this long after the last renewal (the holder renews every
            reconcile pass, 1 s by default; 15 s rides out a slow pass or two).
        clock: unix seconds (shared by every process that reads the file).
    """

    def __init__(self, path: Path, duration_s: float = 15.0,
                 clock: Callable[[], float] = time.time) -> None:
        if not duration_s > 0:
            raise ConfigError(f"lease duration_s={duration_s} must be > 0 seconds")
        self.path = Path(path)
        self.duration_s = duration_s
        self.clock = clock

    def _live_holder(self, data: Any, now: float) -> str | None:
        if not isinstance(data, dict) or not isinstance(data.get("holder"), str):
            return None
        try:
            renewed, duration = float(data["renewed_at"]), float(data["duration_s"])
        except (KeyError, TypeError, ValueError):
            return None
        return data["holder"] if now - renewed < duration else None

    def holder(self) -> str | None:
        return self._live_holder(_read_json(self.path), self.clock())

    def try_acquire(self, identity: str) -> bool:
        with _locked(self.path):
            data = _read_json(self.path)
            now = self.clock()
            live = self._live_holder(data, now)
            if live is not None and live != identity:
                return False
            transitions = int(data.get("transitions", 0)) if isinstance(data, dict) else 0
            previous = data.get("holder") if isinstance(data, dict) else None
            if previous != identity:
                transitions += 1
                _log.info("%s takes the rollout lease (was %s)", identity, previous)
            body = {"holder": identity, "renewed_at": now, "duration_s": self.duration_s,
                    "transitions": transitions}
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body) + "\n")
            os.replace(tmp, self.path)  # not fsync'd: a lost renewal only expires sooner
            return True


# --------------------------------------------------------------------------- peers


@dataclass(frozen=True)
class Peer:
    """A pod of the fleet: its name and where it answers."""

    name: str
    predict_url: str
    sidecar_url: str  # the public port: /metrics, GET /state
    write_url: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class PeerSource(Protocol):
    def peers(self) -> list[Peer]:
        """Every pod of the fleet now (this one included or not: callers skip their own
        name)."""
        ...


@dataclass
class StaticPeers:
    """A fixed list (tests; a fleet without discovery)."""

    items: list[Peer] = field(default_factory=list)

    def peers(self) -> list[Peer]:
        return list(self.items)


def read_fleet_file(path: Path) -> list[Peer]:
    """The pods of ``.run/fleet.json`` (``{"pods": [{"name", "predict_url",
    "sidecar_url", "write_url"}]}``); [] when it is absent.

    Raises:
        ConfigError: it exists but is not such a file.
    """
    data = _read_json(Path(path))
    if data is None:
        return []
    pods = data.get("pods") if isinstance(data, dict) else None
    if not isinstance(pods, list):
        raise ConfigError(f"{path} must hold {{\"pods\": [{{\"name\", \"predict_url\", "
                          f"\"sidecar_url\"}}, ...]}}; rewrite it with make fleet")
    out = []
    for p in pods:
        try:
            out.append(Peer(name=str(p["name"]), predict_url=str(p["predict_url"]),
                            sidecar_url=str(p["sidecar_url"]).rstrip("/"),
                            write_url=p.get("write_url")))
        except (KeyError, TypeError):
            raise ConfigError(f"{path}: pod entry {p!r} lacks name, predict_url or "
                              "sidecar_url") from None
    return out


def write_fleet_file(path: Path, pods: Iterable[Peer]) -> None:
    """Write ``.run/fleet.json`` (durably: a sidecar may read it at any time)."""
    body = {"pods": [p.to_json() for p in pods]}
    write_durably(path, (json.dumps(body, indent=1) + "\n").encode())


@dataclass
class FilePeers:
    """The pods listed in a fleet file (:func:`read_fleet_file`), read on every call."""

    path: Path

    def peers(self) -> list[Peer]:
        return read_fleet_file(self.path)
