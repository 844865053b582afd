"""Command-line flags generated from config dataclasses: each default is written once.

A config field says how it is set from outside in its metadata::

    window_s: float = field(default=10.0, metadata=flag(
        "--tune-window-s", env=settings.DLRM_TUNE_WINDOW_S,
        help="seconds of traffic the tuner measures a setting on, at most"))

:func:`options` walks a dataclass (and the dataclasses it holds, such as
``SidecarConfig.tuner``) and returns one :class:`Option` per field with such metadata;
:func:`add_options` adds their flags to an ``argparse`` parser (default: the environment
variable when set, else the field's default; the help shows both), and :func:`build`
makes the dataclass back from the parsed arguments. The flag's type comes from the
field's annotation: ``int``, ``float``, ``str``, ``Path``, ``bool`` (``on``/``off``, or a
``store_true`` switch), ``tuple[Path, ...]`` (a repeatable flag; its variable is
``:``-separated), each optionally ``| None``. ``python -m serve.ops.configdoc`` documents
the same options.

Precedence: the flag, else the variable, else the field's default (``cli_default`` when the
command line's default differs on purpose from the library's, e.g. the sidecar's
``--multiproc-dir``). Light: stdlib and ``serve.settings`` only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.settings import EnvVar

__all__ = ["KEY", "Flag", "Option", "add_options", "build", "flag", "options"]

#: The metadata key of a field's :class:`Flag`.
KEY = "flag"


class _Same:
    """``cli_default`` not given: the command line's default is the field's."""

    def __repr__(self) -> str:
        return "SAME"


_SAME: Any = _Same()
_KINDS = {int: "int", float: "float", str: "str", Path: "path", bool: "bool"}

@dataclass(frozen=True)
class Flag:
    """How one config field is set from outside (see :func:`flag`)."""

    name: str | None
    help: str
    env: EnvVar | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False
    cli_default: Any = _SAME


def flag(name: str | None = None, *, help: str, env: EnvVar | None = None,
         choices: Sequence[str] | None = None, switch: bool = False,
         cli_default: Any = _SAME) -> dict[str, Flag]:
    """The ``metadata`` of a config field set by a flag and/or an environment variable.

    Args:
        name: the flag (``--tune-window-s``); None: no flag (documented, or set by the
            caller from ``env``, such as the sidecar's token).
        help: what the setting does (the flag's help and the docs' text).
        env: the variable (:mod:`serve.settings`) that sets the flag's default.
        choices: the allowed values of a ``str`` field.
        switch: a ``bool`` field set by the bare flag (``store_true``), not ``on``/``off``.
        cli_default: the command line's default when it differs from the field's.
    """
    return {KEY: Flag(name, help, env, tuple(choices) if choices else None, switch,
                      cli_default)}


@dataclass(frozen=True)
class Option:
    """A config field with a :class:`Flag`, resolved against its dataclass.

    Attributes:
        path: field names from the root config (``("tuner", "window_s")``).
        spec: the field's :class:`Flag`.
        kind: ``int``, ``float``, ``str``, ``path``, ``paths`` or ``bool``.
        optional: the annotation allows None.
        field_default: the field's default (``default_factory`` called).
    """

    path: tuple[str, ...]
    spec: Flag
    kind: str
    optional: bool
    field_default: Any

    @property
    def dest(self) -> str:
        """The argparse destination: the flag without ``--``, ``-`` as ``_``."""
        return (self.spec.name or "").lstrip("-").replace("-", "_")

    @property
    def default(self) -> Any:
        """The default the command line starts from (before the environment)."""
        cli = self.spec.cli_default
        return self.field_default if cli is _SAME else cli

    def to_cli(self, value: Any) -> Any:
        """A field value as argparse holds it (paths as text, booleans as on/off)."""
        if value is None:
            return None
        if self.kind == "bool" and not self.spec.switch:
            return "on" if value else "off"
        if self.kind == "path":
            return str(value)
        if self.kind == "paths":
            return tuple(str(p) for p in value)
        return value

    def from_cli(self, value: Any) -> Any:
        """What argparse parsed, as the field's type ("" is None for an optional path)."""
        if self.kind == "bool":
            return value == "on" if isinstance(value, str) else bool(value)
        if self.kind == "path":
            if value is None or (self.optional and value == ""):
                return None
            return Path(value)
        if self.kind == "paths":
            return tuple(Path(p) for p in value or ())
        return value

    def from_env(self, environ: Mapping[str, str]) -> Any:
        """The variable's value as the field's type; None when it is unset (or none)."""
        env = self.spec.env
        if env is None:
            return None
        if self.kind == "int":
            return env.get_int(environ)
        if self.kind == "float":
            return env.get_float(environ)
        if self.kind == "bool":
            return env.get_bool(environ)
        if self.kind == "paths":
            return tuple(Path(p) for p in env.get_list(environ)) or None
        text = env.get(environ)
        return Path(text) if text is not None and self.kind == "path" else text

    def shown(self, value: Any) -> str:
        """A default for people: ``unset`` for None, paths joined with ``:``."""
        value = self.to_cli(value)
        if value is None or value == ():
            return "unset"
        return ":".join(value) if isinstance(value, tuple) else str(value)


def _kind(hint: Any) -> tuple[str, bool] | None:
    """(kind, optional) of an annotation; None for anything else (a nested config)."""
    args = typing.get_args(hint)
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        if len(rest) != 1:
            return None
        hint, args = rest[0], typing.get_args(rest[0])
    if typing.get_origin(hint) is tuple and args[:1] == (Path,):
        return "paths", optional
    kind = _KINDS.get(hint)
    return (kind, optional) if kind else None


def options(cls: type, path: tuple[str, ...] = ()) -> list[Option]:
    """Every field of ``cls`` (and of the dataclasses its fields hold) with a :class:`Flag`,
    in field order."""
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        spec = f.metadata.get(KEY)
        if spec is None:
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                found += options(hint, (*path, f.name))
            continue
        resolved = _kind(hint)
        if resolved is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag cannot set {hint!r}")
        default = f.default_factory() if callable(f.default_factory) else f.default
        found.append(Option((*path, f.name), spec, *resolved, default))
    return found


def _help(opt: Option, default: Any) -> str:
    shown = ("on" if default else "off") if opt.spec.switch else opt.shown(default)
    text = f"{opt.spec.help} (default: {shown})"
    if opt.spec.env is not None:
        text += f" [{opt.spec.env.name}]"
    return text.replace("%", "%%")


class _Repeat(argparse.Action):
    """A repeatable flag whose first use replaces its default (a tuple) instead of adding
    to it, as ``action="append"`` would."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if isinstance(items, tuple) else items), values])


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                opts: Sequence[Option], environ: Mapping[str, str] | None = None) -> None:
    """Add a flag per option that has one. Its default is the variable's value when set
    (read from ``environ``, default ``os.environ``, now), else the option's default.

    Raises:
        ConfigError: a variable that does not parse as the field's type.
    """
    env = os.environ if environ is None else environ
    for opt in opts:
        if opt.spec.name is None:
            continue
        from_env = opt.from_env(env)
        default = opt.default if from_env is None else from_env
        kw: dict[str, Any] = {"dest": opt.dest, "help": _help(opt, default)}
        if opt.kind == "bool" and opt.spec.switch:
            kw.update(action="store_true", default=bool(default))
        elif opt.kind == "bool":
            kw.update(choices=("on", "off"), default=opt.to_cli(default))
        elif opt.kind == "paths":
            kw.update(action=_Repeat, default=opt.to_cli(default), metavar="DIR")
        else:
            kw.update(default=opt.to_cli(default), choices=opt.spec.choices)
            if opt.kind in ("int", "float"):
                kw["type"] = int if opt.kind == "int" else float
        parser.add_argument(opt.spec.name, **kw)


def build(cls: type, args: argparse.Namespace, overrides: Mapping[str, Any] | None = None,
          path: tuple[str, ...] = ()) -> Any:
    """``cls`` from parsed arguments: each field with a flag from its flag, each nested
    config built the same way, the rest left to their defaults; ``overrides`` (field
    name -> value, top level only) win."""
    kwargs: dict[str, Any] = dict(overrides or {})
    by_field = {o.path[len(path)]: o for o in options(cls, path)}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            continue
        opt = by_field.get(f.name)
        if opt is not None and len(opt.path) == len(path) + 1:
            if opt.spec.name is not None:
                kwargs[f.name] = opt.from_cli(getattr(args, opt.dest))
        elif opt is not None:
            kwargs[f.name] = build(hints[f.name], args, path=(*path, f.name))
    return cls(**kwargs)
