"""Every domain error of the service, each with the HTTP status it maps to.

Messages state the value, the rule and what to do. Edges (the TorchServe handler,
the sidecar, CLIs) convert these once: ``err.status`` and ``err.to_json()``.
"""
from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ArtifactError",
    "CheckpointError",
    "ConfigError",
    "Forbidden",
    "InvalidInput",
    "ModelContractError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RequestTimeout",
    "ServeError",
    "ShardingError",
    "Unauthorized",
    "UnknownProfileError",
    "UnsupportedMediaType",
    "UpstreamUnavailable",
    "describe_field_errors",
    "shown",
]


class ServeError(Exception):
    """Base class. ``status`` is the HTTP code at an edge; ``kind`` the JSON ``type``."""

    status: int = 500
    kind: str = "InternalError"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, Any]:
        return {"code": self.status, "type": self.kind, "message": self.message}


class InvalidInput(ServeError):
    """A request body breaks the API contract (field named in the message)."""

    status = 400
    kind = "InvalidInput"


class PayloadTooLarge(ServeError):
    status = 413
    kind = "PayloadTooLarge"


class UnsupportedMediaType(ServeError):
    status = 415
    kind = "UnsupportedMediaType"


class NotFound(ServeError):
    """A path names something this server does not serve (e.g. another model)."""

    status = 404
    kind = "NotFound"


class Unauthorized(ServeError):
    status = 401
    kind = "Unauthorized"


class Forbidden(ServeError):
    status = 403
    kind = "Forbidden"


class UpstreamUnavailable(ServeError):
    """TorchServe (or another dependency) did not answer as needed."""

    status = 503
    kind = "UpstreamUnavailable"


class Overloaded(ServeError):
    """A bounded server is at its limit (requests, bytes in flight, parse slots): refused
    at once, before the work, so the client can retry elsewhere or later."""

    status = 429
    kind = "Overloaded"


class RequestTimeout(ServeError):
    """A request's body did not arrive within the server's deadline."""

    status = 408
    kind = "RequestTimeout"


class ConfigError(ServeError, ValueError):
    """A configuration value is out of its allowed range or of the wrong type."""

    status = 400
    kind = "ConfigError"


class UnknownProfileError(ConfigError):
    kind = "UnknownProfile"


class ModelContractError(ConfigError):
    """A user's model factory, or the model it returns, does not fit the model contract
    (docs/own-model.md)."""

    kind = "ModelContractError"


class CheckpointError(ServeError):
    """A checkpoint or one of its shards is missing, unreadable or inconsistent."""

    kind = "CheckpointError"


class ArtifactError(ServeError):
    """A serving artifact is missing, corrupt or of an unknown format version."""

    kind = "ArtifactError"


class ShardingError(ConfigError):
    """The tables cannot be sharded over the requested world size."""

    kind = "ShardingError"


class Conflict(ServeError):
    """The request clashes with one in progress (e.g. a second concurrent PUT /batching)."""

    status = 409
    kind = "Conflict"


__all__.append("Conflict")


class InvalidDelta(InvalidInput):
    """An embedding delta that cannot be read or does not fit the model (400).

    ``field`` names the part of the delta at fault (``sha256``, ``tables[3].ids``...);
    it is in the JSON body so a client can tell what to fix.
    """

    kind = "InvalidDelta"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "field": self.field}


class DeltaConflict(Conflict):
    """A well-formed delta that does not apply here: another base version, not the
    next sequence number of its version, or built on another delta than the one this pod
    holds (409). Nothing was changed.

    ``reason`` is a bounded label (``base_version``, ``sequence``, ``parent_mismatch``,
    ``volume_only``; metrics count refusals by it); ``details`` are extra JSON fields
    (e.g. both digests of a ``parent_mismatch``).
    """

    kind = "DeltaConflict"

    def __init__(self, field: str, message: str, *, reason: str = "conflict",
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = reason
        self.details = dict(details or {})

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "field": self.field, "reason": self.reason,
                **self.details}


__all__ += ["DeltaConflict", "InvalidDelta"]


class QualityError(ServeError):
    """A built model misses its quality bar (e.g. int8 AUC below fp32 AUC - 0.001)."""

    kind = "QualityError"


__all__.append("QualityError")


class CapacityError(ServeError):
    """A capacity measurement (``make capacity``) gave no usable knee or could not run."""

    kind = "CapacityError"


__all__ += ["CapacityError"]


class InsufficientMemory(ServeError):
    """A change would need more memory than the pod's limit leaves (e.g. a version switch
    that runs the old and the new version's workers side by side): refused, never OOM."""

    status = 507
    kind = "InsufficientMemory"


__all__ += ["InsufficientMemory"]


_SHOWN = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 80, 80, 40
_SHOWN.maxdict = _SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = 6


def shown(value: Any) -> str:
    """``repr(value)`` bounded in depth, items and length, for echoing input in a message:
    a body or a ConfigMap can hold a huge or deeply nested value (YAML aliases nest
    exponentially), and an error message must stay a line."""
    return _SHOWN.repr(value)


def describe_field_errors(errors: Iterable[Mapping[str, Any]], *, prefix: str = "",
                          unknown_field: str = "unknown field") -> list[str]:
    """One ``field: rule (got value)`` line per pydantic error (``ValidationError.errors()``).

    ``loc`` is joined with dots (a leading ``body`` from FastAPI is dropped), pydantic's
    ``Value error, `` prefix is removed, an unknown key reads ``unknown_field``, and a
    missing field shows no value. Used by the desired-state schema and the sidecar's
    request validation, so both word the same error the same way.
    """
    lines = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = unknown_field
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = "" if e.get("type") == "missing" else f" (got {shown(e.get('input'))})"
        lines.append(f"{prefix}{loc}: {msg}{got}")
    return lines
