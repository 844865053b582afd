"""The per-schema helpers every decoder of ``serve.api`` shares: the public toolkit of
the body forms (:mod:`serve.api.json_body`, :mod:`serve.api.binary`, :mod:`serve.api.oip`,
:mod:`serve.api.decode`).

* :class:`Spec`: what the decoders need of one request schema (F feature names in
  request order, N dense features, the max ids of each feature), built once per schema
  by :func:`spec_of` (:data:`DEFAULT_SPEC` for :data:`serve.api.request.DEFAULT_SCHEMA`);
  :class:`Caps`: the effective most ids per feature under one ``max_ids_per_feature``.
* The validation helpers whose wording every form shares: :func:`check_size`,
  :func:`id_problem` (:data:`ID_RULE`), :func:`cap_rule`, :func:`not_a`, :func:`show`,
  :func:`json_type`.
* :func:`example_arrays`: the random instances behind ``example_request`` and
  ``example_binary``.

Shapes as in :mod:`serve.api.request`: B samples, F sparse features, N dense features.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import orjson

from serve.api.config import HandlerConfig
from serve.api.request import DEFAULT_SCHEMA, INT64_MAX
from serve.errors import PayloadTooLarge
from serve.schema import ModelSchema

__all__ = [
    "DEFAULT_SPEC",
    "ID_RULE",
    "Caps",
    "Spec",
    "cap_rule",
    "check_size",
    "example_arrays",
    "id_problem",
    "json_type",
    "not_a",
    "show",
    "spec_of",
]

ID_RULE = "ids must be JSON integers in [0, 2^63-1]"


def _names_text(names: Sequence[str]) -> str:
    """Feature names for messages, in order: ``C1..C26`` when they are a prefix numbered
    1..F (F >= 3), else all of them comma-separated."""
    m = re.fullmatch(r"(.*?)1", names[0]) if len(names) >= 3 else None
    if m is not None and all(n == f"{m.group(1)}{i}" for i, n in enumerate(names, 1)):
        return f"{names[0]}..{names[-1]}"
    return ", ".join(names)


class Caps:
    """The effective most ids per feature for one ``cfg.max_ids_per_feature``.

    Attributes:
        arr: int64 (F,) ``min(schema.max_ids[f], cfg_cap)``.
        lo, hi: its min and max (``lo == hi``: one cap for every feature, a scalar check).
        by_model: per feature, whether the schema's max_ids is the tighter bound (the
            message then names the model's limit, not the handler's).
    """

    __slots__ = ("_cells", "arr", "by_model", "hi", "lo")

    def __init__(self, max_ids: tuple[int, ...], cfg_cap: int) -> None:
        self.arr = np.minimum(np.array(max_ids, dtype=np.int64), cfg_cap)
        self.lo, self.hi = int(self.arr.min()), int(self.arr.max())
        self.by_model = tuple(m < cfg_cap for m in max_ids)
        self._cells: dict[int, tuple[int, ...]] = {}

    def per_cell(self, n: int) -> tuple[int, ...]:
        """The cap of each (feature, sample) cell of B = ``n`` samples, feature-major
        (F*n,): for Python's reductions over small requests (memoized per n)."""
        t = self._cells.get(n)
        if t is None:
            if len(self._cells) >= 64:
                self._cells.clear()
            t = self._cells[n] = tuple(c for c in self.arr.tolist() for _ in range(n))
        return t

    def exceeded(self, lengths: np.ndarray) -> np.ndarray | None:
        """lengths (F, B) -> bool (F, B) where a cap is exceeded, or None: none is."""
        if not lengths.size or int(lengths.max()) <= self.lo:
            return None
        over = lengths > self.arr[:, None]
        return over if over.any() else None


class Spec:
    """What the decoders need of one request schema, computed once (:func:`spec_of`).

    Only the request-facing part of a schema matters (N, the feature names in order,
    max ids per feature; :meth:`ModelSchema.request_differences`): models that differ in
    table rows, dims or dtypes share one ``Spec``.

    Attributes:
        names: the F feature names, request order.
        name_set: frozenset of ``names``.
        features_of: a dict -> the tuple of its F values in request order (an
            ``operator.itemgetter``; KeyError when one is missing).
        nf, nd: F and N.
        max_ids: the schema's most ids of each feature (F,).
        names_text: the names as the messages show them (:func:`_names_text`).
    """

    __slots__ = ("_caps", "features_of", "max_ids", "name_set", "names", "names_text", "nd",
                 "nf")

    def __init__(self, dense: int, names: tuple[str, ...], max_ids: tuple[int, ...]) -> None:
        self.names = names
        self.name_set = frozenset(names)
        self.nf, self.nd = len(names), dense
        self.max_ids = max_ids
        if self.nf == 1:  # itemgetter of one key returns the value, not a 1-tuple
            only = self.names[0]
            self.features_of: Callable[[Any], tuple[Any, ...]] = lambda d: (d[only],)
        else:
            self.features_of = operator.itemgetter(*self.names)
        self.names_text = _names_text(self.names)
        self._caps: dict[int, Caps] = {}

    def caps(self, cfg_cap: int) -> Caps:
        """The effective caps under ``cfg.max_ids_per_feature == cfg_cap`` (memoized)."""
        c = self._caps.get(cfg_cap)
        if c is None:
            if len(self._caps) >= 16:
                self._caps.clear()
            c = self._caps[cfg_cap] = Caps(self.max_ids, cfg_cap)
        return c

    def sparse_example(self, cell: str) -> str:
        """``{"C1": <cell>, ..., "C26": <cell>}`` for messages (all names when F <= 2)."""
        if self.nf <= 2:
            return "{" + ", ".join(f'"{n}": {cell}' for n in self.names) + "}"
        return f'{{"{self.names[0]}": {cell}, ..., "{self.names[-1]}": {cell}}}'


@lru_cache(maxsize=64)
def _build_spec(dense: int, names: tuple[str, ...], max_ids: tuple[int, ...]) -> Spec:
    return Spec(dense, names, max_ids)


def part_spec(spec: Spec, names: tuple[str, ...], dense: int) -> Spec:
    """The helpers for one part of a ranking request: ``names`` (a subset of ``spec``'s
    features, in its order) with their caps, and ``dense`` dense features (N or 0);
    built once per distinct part (:func:`_build_spec`'s cache)."""
    index = {n: i for i, n in enumerate(spec.names)}
    return _build_spec(dense, names, tuple(spec.max_ids[index[n]] for n in names))


def _request_key(schema: ModelSchema) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """What requests must match of ``schema``: (N, feature names, max ids per feature)."""
    return schema.dense, schema.feature_names, schema.max_ids


DEFAULT_SPEC = _build_spec(*_request_key(DEFAULT_SCHEMA))
# id(schema) -> (schema, spec): reading a ModelSchema's request key costs ~5 us (and
# hashing it ~7 us), a good part of a small request's fast path; an identity hit ~0.1 us.
_SPEC_BY_ID: dict[int, tuple[ModelSchema, Spec]] = {}


def spec_of(schema: ModelSchema | None) -> Spec:
    """The decoders' helpers for ``schema`` (None: :data:`DEFAULT_SCHEMA`), built once per
    request schema (``functools.lru_cache`` keyed by N, names and max ids) and found by
    the schema object's identity afterwards.

    Raises:
        TypeError: ``schema`` is not a ModelSchema.
    """
    if schema is None:
        return DEFAULT_SPEC
    hit = _SPEC_BY_ID.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    if not isinstance(schema, ModelSchema):
        raise TypeError(f"schema must be a serve.schema.ModelSchema or None, got "
                        f"{type(schema).__name__}")
    spec = _build_spec(*_request_key(schema))
    if len(_SPEC_BY_ID) >= 16:
        _SPEC_BY_ID.clear()
    _SPEC_BY_ID[id(schema)] = (schema, spec)
    return spec


def check_size(size: int, cfg: HandlerConfig) -> None:
    if size > cfg.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {size} bytes; the limit is {cfg.max_body_bytes} bytes; "
            "split the instances over several requests")


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def not_a(v: Any, what: str) -> str:
    """'"abc" is a string, not a number' / 'null is not a number'."""
    if v is None:
        return f"null is not a{'n' if what[0] in 'aeiou' else ''} {what}"
    return f"{show(v)} is a {json_type(v)}, not a{'n' if what[0] in 'aeiou' else ''} {what}"


def show(v: Any) -> str:
    """A value as JSON text, cut short (messages must stay small)."""
    try:
        s = orjson.dumps(v).decode()
    except TypeError:
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def id_problem(v: Any) -> str | None:
    t = type(v)
    if t is int:
        if v < 0:
            return f"{v} is negative; ids must be integers >= 0"
        if v > INT64_MAX:
            return f"{v} is greater than 2^63-1 ({INT64_MAX}); {ID_RULE}"
        return None
    if t is float:
        if v.is_integer() and abs(v) > INT64_MAX:
            return f"{show(v)} is beyond the 64-bit integer range; {ID_RULE}"
        return f"{show(v)} is not an integer; {ID_RULE} (no decimal point or exponent)"
    return f"{not_a(v, 'integer')}; {ID_RULE}"


def cap_rule(caps: Caps, f: int, spec: Spec) -> str:
    """Why feature ``f`` may carry no more ids, as the tail of a message."""
    cap = int(caps.arr[f])
    if caps.by_model[f]:
        return (f"the model accepts at most {cap} id{'s' if cap != 1 else ''} in "
                f"{spec.names[f]} (its max_ids); drop or hash the extra ids")
    return f"at most {cap} ids per feature are allowed; drop or hash the extra ids"


def example_arrays(n: int, seed: int, max_id: int, spec: Spec, multi_hot: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dense float64 (n, N) rounded to 4 decimals, lengths int32 (F, n), ids int64 (nnz,)
    feature-major.

    One-hot: every length is 1 (the ids are drawn as (F, n) right after the dense values,
    so a seed gives the same instances whatever ``multi_hot`` later adds). Multi-hot:
    feature f has 0..``max_ids[f]`` ids per instance.
    """
    rng = np.random.default_rng(seed)
    dense = np.round(rng.random((n, spec.nd)) * 4, 4)
    ids = rng.integers(0, max_id, size=(spec.nf, n))
    if not multi_hot:
        return dense, np.ones((spec.nf, n), dtype=np.int32), ids.reshape(-1)
    top = np.array(spec.max_ids, dtype=np.int64)[:, None]
    lengths = rng.integers(0, top + 1, size=(spec.nf, n)).astype(np.int32)
    return dense, lengths, rng.integers(0, max_id, size=int(lengths.sum()))
