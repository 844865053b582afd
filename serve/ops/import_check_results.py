"""The records :mod:`serve.ops.import_check` fills: a fit, an import, each bad request, a
row per model, the switch under load and the whole report (``to_dict``: its JSON)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from serve.ops.import_check_config import CheckConfig

__all__ = [
    "BadRequest",
    "CheckReport",
    "FitResult",
    "ImportResult",
    "ModelRow",
    "SwitchResult",
]


@dataclass
class FitResult:
    """A trained checkpoint and the factory that imports it."""

    factory: str
    checkpoint: Path
    seed: int
    seconds: float
    world_size: int = 2
    final_loss: float | None = None


@dataclass
class ImportResult:
    """One imported version: the importer's JSON line and its report."""

    version: str
    factory: str
    checkpoint: Path
    max_abs_diff: float
    seconds: float
    report: dict[str, Any] = field(repr=False)


@dataclass
class BadRequest:
    """One malformed request and how the service answered it."""

    case: str
    must_name: tuple[str, ...]   # every one must appear in the message
    status: int
    message: str
    names_it: bool

    @property
    def ok(self) -> bool:
        return self.status == 400 and self.names_it


@dataclass
class ModelRow:
    """Everything checked for one model; ``errors`` empty means it passed."""

    model: str
    version: str | None = None
    dense_kind: str | None = None
    dense: int | None = None
    tables: int | None = None
    features: int | None = None
    fit_seconds: float | None = None
    final_loss: float | None = None
    import_seconds: float | None = None
    import_max_abs_diff: float | None = None
    converge_seconds: float | None = None
    schema_match: bool | None = None
    http_max_abs_diff: float | None = None
    http_instances: int | None = None
    http_ids: int | None = None
    bad_requests: list[BadRequest] = field(default_factory=list)
    http_requests: int = 0
    http_5xx: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def bad_ok(self) -> int:
        return sum(b.ok for b in self.bad_requests)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bad_requests"] = [{**dataclasses.asdict(b), "ok": b.ok} for b in self.bad_requests]
        d["ok"] = self.ok
        return d


@dataclass
class SwitchResult:
    """The version switch under load."""

    from_version: str
    to_version: str
    clients: int
    served: int = 0
    failed: int = 0
    served_during_switch: int = 0
    http_5xx: int = 0
    converge_seconds: float | None = None
    versions: dict[str, int] = field(default_factory=dict)
    versions_after: dict[str, int] = field(default_factory=dict)
    after_max_abs_diff: float | None = None
    answers_changed: bool | None = None
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


@dataclass
class CheckReport:
    """The whole run: a row per model and the switch (None: ``own_ranker`` not selected)."""

    rows: list[ModelRow]
    switch: SwitchResult | None
    seconds: float = 0.0
    switch_errors: list[str] = field(default_factory=list)
    http_requests: int = 0    # every request of the run, the switch's load included
    http_5xx: int = 0

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self.rows) and not self.switch_errors and not self.http_5xx
                and (self.switch is None or self.switch.ok))

    def to_dict(self, config: CheckConfig | None = None) -> dict[str, Any]:
        return {
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": None if config is None else {
                k: (os.fspath(v) if isinstance(v, Path) else v)
                for k, v in dataclasses.asdict(config).items()},
            "models": [r.to_dict() for r in self.rows],
            "switch": None if self.switch is None else self.switch.to_dict(),
            "switch_errors": self.switch_errors,
            "http_requests": self.http_requests,
            "http_5xx": self.http_5xx,
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
        }
