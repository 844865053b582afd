"""The model versions' schemas as the sidecar sees them: read once from each version's
build report, and the rollout's check that a candidate takes the stable version's requests.

A version's build report is written once and never changed (the repository's versions are
immutable), so :class:`SchemaCache` reads and parses it at most once per version: GET
/state and the metric scrapes then cost a dict lookup. Only the absence of a report is
not remembered (a version being copied in has its report written last): it is looked up
again the next time.

Example::

    schemas = SchemaCache(repository.report)     # or, in a test, {"v1": report}.__getitem__
    schemas.describe("v1")   # {"dense": 13, "sparse": [{"name": "C1", ...}, ...]} or None
    check_rollout_schema(schemas, "v1", "v2")    # Conflict (409) if requests differ
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from serve.errors import ConfigError, Conflict
from serve.profiles import schema_from_report
from serve.schema import ModelSchema

__all__ = ["ReportReader", "SchemaCache", "check_rollout_schema", "check_switch_schema"]

_log = logging.getLogger(__name__)

#: A version's build report (``ModelRepository.report``). Raises for a version without
#: one (``ConfigError`` from the repository; ``KeyError`` from a dict's ``__getitem__``),
#: or an unreadable one (``OSError``, bad JSON, a JSON value that is not an object).
ReportReader = Callable[[str], Mapping[str, Any]]


class SchemaCache:
    """Each version's :class:`~serve.schema.ModelSchema`, from its build report, once.

    Args:
        report_of: a version's build report; raising ``KeyError``, ``OSError``,
            ``TypeError`` or ``ValueError`` (``ConfigError``, bad JSON) means it has none
            (yet).
    """

    def __init__(self, report_of: ReportReader) -> None:
        self._report_of = report_of
        self._schemas: dict[str, ModelSchema | None] = {}
        self._described: dict[str, dict[str, Any] | None] = {}
        self._lock = threading.Lock()

    def schema(self, version: str) -> ModelSchema | None:
        """The schema of ``version``; None when it has no report, or a report from which
        no schema can be derived (logged once: a foreign or broken build)."""
        with self._lock:
            if version in self._schemas:
                return self._schemas[version]
        try:
            report = self._report_of(version)
        except (KeyError, OSError, TypeError, ValueError):
            return None  # no report (yet): not remembered, looked up again next time
        try:
            schema: ModelSchema | None = schema_from_report(report)
        except ConfigError as e:
            _log.warning("model version %s has no usable schema: %s", version, e.message)
            schema = None
        with self._lock:
            self._schemas[version] = schema
            self._described[version] = schema.describe() if schema is not None else None
        return schema

    def describe(self, version: str) -> dict[str, Any] | None:
        """``schema(version).describe()`` (computed once), or None (see :meth:`schema`).
        The dict is shared: callers must not change it."""
        with self._lock:
            if version in self._described:
                return self._described[version]
        self.schema(version)
        with self._lock:
            return self._described.get(version)


def check_rollout_schema(schemas: SchemaCache, stable: str, candidate: str) -> None:
    """Refuse a rollout whose candidate takes other requests than the stable version.

    A rollout sends one stream of requests to both versions (canary: a share each;
    shadow: every request to both), so both must accept the same requests: dense count,
    sparse features and their order, max ids per feature. Table sizes, dims and dtypes
    may differ. A version without a derivable schema (GET /state shows ``schema: null``)
    cannot be compared and is not refused here.

    Raises:
        Conflict: (409) the request schemas differ; the message names both versions,
            each difference and what to do.
    """
    differences = _differences(schemas, stable, candidate)
    if differences:
        raise Conflict(
            f"rollout.candidate: {candidate!r} takes other requests than the stable version "
            f"{stable!r} ({'; '.join(differences)}; first is {stable}, second {candidate}); "
            "a rollout sends the same requests to both versions, so their request schemas "
            "(dense count, sparse features and their order, max_ids) must be equal: import "
            "the candidate with the same features, or switch the version with PUT /state "
            "instead of a rollout (model.version set to the candidate, rollout null)")


def check_switch_schema(schemas: SchemaCache, declared: str, new: str,
                        intended: bool = False) -> None:
    """Refuse a switch of ``model.version`` from ``declared`` to a version that takes
    other requests (the same comparison as :func:`check_rollout_schema`), unless the
    declaration says the change is ``intended`` (``model.schema_change: true``): after
    the switch, every client still sending the old schema gets 400s.

    Raises:
        Conflict: (409) the request schemas differ and the change is not declared
            intended; the message names both versions, each difference and what to do.
    """
    if intended:
        return
    differences = _differences(schemas, declared, new)
    if differences:
        raise Conflict(
            f"model.version: {new!r} takes other requests than the declared version "
            f"{declared!r} ({'; '.join(differences)}; first is {declared}, second {new}); "
            f"after the switch every client still sending {declared}'s requests gets 400s. "
            "If the clients are ready for the new schema, declare it intended: "
            '"model": {"version": ' + f'"{new}", "schema_change": true' + "}; else import "
            f"{new} with the same features")


def _differences(schemas: SchemaCache, first: str, second: str) -> list[str]:
    """How ``second``'s requests differ from ``first``'s; [] when they are the same version
    or either has no derivable schema (GET /state shows ``schema: null``): not compared."""
    if first == second:
        return []
    mine, theirs = schemas.schema(first), schemas.schema(second)
    if mine is None or theirs is None:
        return []
    return list(mine.request_differences(theirs))
