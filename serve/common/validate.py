"""Shared checks of configuration values: one message shape, the project's errors.

Every check returns the value when it passes and otherwise raises (by default)
:class:`~serve.errors.ConfigError` with a message that names the setting, the value and
the rule, plus what to do (``then``)::

    positive_int("handler.max_instances", 0)
    # ConfigError: handler.max_instances=0 must be an integer >= 1
    int_at_least("file_bytes", 10, 4096, then=" (bytes)")
    # ConfigError: file_bytes=10 must be an integer >= 4096 (bytes)
    positive_number("--p99-goal-ms", 0.0)
    # ConfigError: --p99-goal-ms 0.0 must be a finite number > 0
    boolean("label_shuffle", "yes")
    # ConfigError: label_shuffle='yes' must be true or false

A command-line flag (a name starting with ``--``) is shown as typed (``--steps 0``), any
other name as ``name=value``. Integers are ``int`` but never ``bool`` (``True`` is not a
count); numbers are ``int`` or ``float``, never ``bool``.

``error`` is the exception class to raise (``ModelContractError``, ``ValueError``...), or
any callable that makes one from the message, e.g. for an error that also names a field::

    int_at_least("sequence", 0, 1, error=lambda m: InvalidDelta("header.sequence", m))
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeGuard

from serve.errors import ConfigError

__all__ = [
    "ErrorFactory",
    "boolean",
    "int_at_least",
    "int_in_range",
    "is_int",
    "is_number",
    "nonneg_number",
    "number_in_range",
    "positive_int",
    "positive_number",
]

#: What ``error=`` takes: an exception class, or a callable making one from the message.
ErrorFactory = Callable[[str], Exception]


def is_int(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[float]:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(name: str, value: Any) -> str:
    return f"{name} {value!r}" if name.startswith("--") else f"{name}={value!r}"


def _fail(name: str, value: Any, rule: str, then: str, error: ErrorFactory) -> Exception:
    return error(f"{_shown(name, value)} must be {rule}{then}")


def int_at_least(name: str, value: Any, lo: int, *, then: str = "",
                 error: ErrorFactory = ConfigError) -> int:
    """``value`` if it is an integer >= ``lo``; else ``error`` ("must be an integer >= lo")."""
    if not is_int(value) or value < lo:
        raise _fail(name, value, f"an integer >= {lo}", then, error)
    return int(value)


def positive_int(name: str, value: Any, *, then: str = "",
                 error: ErrorFactory = ConfigError) -> int:
    """``value`` if it is an integer >= 1 (a count, a size)."""
    return int_at_least(name, value, 1, then=then, error=error)


def int_in_range(name: str, value: Any, lo: int, hi: int, *, then: str = "",
                 error: ErrorFactory = ConfigError) -> int:
    """``value`` if it is an integer in ``lo..hi`` (both included)."""
    if not is_int(value) or not lo <= value <= hi:
        raise _fail(name, value, f"an integer in {lo}..{hi}", then, error)
    return int(value)


def positive_number(name: str, value: Any, *, then: str = "",
                    error: ErrorFactory = ConfigError) -> float:
    """``value`` if it is a finite number > 0 (a duration, a goal)."""
    if not is_number(value) or not (math.isfinite(value) and value > 0):
        raise _fail(name, value, "a finite number > 0", then, error)
    return float(value)


def nonneg_number(name: str, value: Any, *, then: str = "",
                  error: ErrorFactory = ConfigError) -> float:
    """``value`` if it is a finite number >= 0."""
    if not is_number(value) or not (math.isfinite(value) and value >= 0):
        raise _fail(name, value, "a finite number >= 0", then, error)
    return float(value)


def number_in_range(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False,
                    hi_open: bool = False, then: str = "",
                    error: ErrorFactory = ConfigError) -> float:
    """``value`` if it is a number in the interval (``[lo, hi]``; ``lo_open``/``hi_open``
    leave that end out, shown as ``(`` / ``)``)."""
    ok = is_number(value) and not math.isnan(value) \
        and (lo < value if lo_open else lo <= value) \
        and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise _fail(name, value, f"a number in {interval}", then, error)
    return float(value)


def boolean(name: str, value: Any, *, then: str = "",
            error: ErrorFactory = ConfigError) -> bool:
    """``value`` if it is a ``bool`` (not ``0``/``1``, not ``"yes"``): "must be true or false"."""
    if not isinstance(value, bool):
        raise _fail(name, value, "true or false", then, error)
    return value
