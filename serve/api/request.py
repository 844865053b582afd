"""The request schema side of the predict API: what every request form is checked against.

Requests are decoded against the served model's schema (:class:`serve.schema.ModelSchema`;
default :data:`DEFAULT_SCHEMA`, the built-in DLRM: N = 13 dense features, F = 26 sparse
features C1..C26, at most 64 ids each). Shapes: B samples, F sparse features (the schema's
``feature_names``, in that order), N dense features (``schema.dense``), nnz = total ids
of a request. A feature may carry at most ``min(schema.max_ids[f], max_ids_per_feature)``
ids per instance.

Every form decodes into one :class:`ParsedRequest` (dense float32 (B, N), lengths int32
(F, B), values int64 (nnz,) feature-major). Ids are integers in [0, 2^63-1]; dense values
are finite numbers that fit float32. Every violation raises a :mod:`serve.errors`
exception whose message names the field path, the value, the rule and what to do.

Here: the per-schema helpers the decoders share (``_Spec``, built once per request schema
by ``_spec_of``), the Content-Type and ``X-DLRM-Route-Key`` checks, and the validation
helpers both decoders use. The forms themselves: :mod:`serve.api.json_body` (rows,
columnar) and :mod:`serve.api.binary`; one body of any form: :mod:`serve.api.decode`.
Names with a leading underscore are private to ``serve.api``.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import orjson

from serve.api.config import HandlerConfig
from serve.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType
from serve.profiles import get_profile
from serve.schema import ModelSchema
from serve.store.routing import ROUTE_KEY_HEADER, ROUTE_KEY_MAX_CHARS

__all__ = [
    "BINARY_MEDIA_TYPE",
    "DEFAULT_SCHEMA",
    "INT64_MAX",
    "JSON_MEDIA_TYPE",
    "ParsedRequest",
    "check_content_type",
    "check_route_key",
]


INT64_MAX = 2**63 - 1
_ID_RULE = "ids must be JSON integers in [0, 2^63-1]"
JSON_MEDIA_TYPE = "application/json"
BINARY_MEDIA_TYPE = "application/x-dlrm-columnar"
# Media types we decode. `application/json` with or without `; charset=utf-8` (JSON is
# UTF-8 by RFC 8259). A missing Content-Type is accepted too (TorchServe passes none for
# bare clients). `application/x-dlrm-columnar` exactly (no parameters: a charset means
# nothing for binary). Anything else (form-urlencoded, as `curl -d` sends by default;
# text/plain; multipart) gets 415 and names the headers to send.
_JSON_TYPES = frozenset((JSON_MEDIA_TYPE, ""))

#: The built-in DLRM's request schema (N = 13, F = 26: C1..C26, at most 64 ids each): what
#: the decoders check when no ``schema`` is given.
DEFAULT_SCHEMA: ModelSchema = get_profile("small").schema()


def _names_text(names: Sequence[str]) -> str:
    """Feature names for messages, in order: ``C1..C26`` when they are a prefix numbered
    1..F (F >= 3), else all of them comma-separated."""
    m = re.fullmatch(r"(.*?)1", names[0]) if len(names) >= 3 else None
    if m is not None and all(n == f"{m.group(1)}{i}" for i, n in enumerate(names, 1)):
        return f"{names[0]}..{names[-1]}"
    return ", ".join(names)


class _Caps:
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


class _Spec:
    """What the decoders need of one request schema, computed once (:func:`_spec_of`).

    Only the request-facing part of a schema matters (N, the feature names in order,
    max ids per feature; :meth:`ModelSchema.request_differences`): models that differ in
    table rows, dims or dtypes share one ``_Spec``.

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
        self._caps: dict[int, _Caps] = {}

    def caps(self, cfg_cap: int) -> _Caps:
        """The effective caps under ``cfg.max_ids_per_feature == cfg_cap`` (memoized)."""
        c = self._caps.get(cfg_cap)
        if c is None:
            if len(self._caps) >= 16:
                self._caps.clear()
            c = self._caps[cfg_cap] = _Caps(self.max_ids, cfg_cap)
        return c

    def sparse_example(self, cell: str) -> str:
        """``{"C1": <cell>, ..., "C26": <cell>}`` for messages (all names when F <= 2)."""
        if self.nf <= 2:
            return "{" + ", ".join(f'"{n}": {cell}' for n in self.names) + "}"
        return f'{{"{self.names[0]}": {cell}, ..., "{self.names[-1]}": {cell}}}'


@lru_cache(maxsize=16)
def _build_spec(dense: int, names: tuple[str, ...], max_ids: tuple[int, ...]) -> _Spec:
    return _Spec(dense, names, max_ids)


def _request_key(schema: ModelSchema) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """What requests must match of ``schema``: (N, feature names, max ids per feature)."""
    return schema.dense, schema.feature_names, schema.max_ids


_DEFAULT_SPEC = _build_spec(*_request_key(DEFAULT_SCHEMA))
# id(schema) -> (schema, spec): reading a ModelSchema's request key costs ~5 us (and
# hashing it ~7 us), a good part of a small request's fast path; an identity hit ~0.1 us.
_SPEC_BY_ID: dict[int, tuple[ModelSchema, _Spec]] = {}


def _spec_of(schema: ModelSchema | None) -> _Spec:
    """The decoders' helpers for ``schema`` (None: :data:`DEFAULT_SCHEMA`), built once per
    request schema (``functools.lru_cache`` keyed by N, names and max ids) and found by
    the schema object's identity afterwards.

    Raises:
        TypeError: ``schema`` is not a ModelSchema.
    """
    if schema is None:
        return _DEFAULT_SPEC
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


@dataclass
class ParsedRequest:
    """One validated request.

    dense: float32 (B, N); lengths: int32 (F, B) ids per (feature, sample);
    values: int64 (nnz,) feature-major (all of C1's ids for samples 0..B-1, then C2 ...).
    """

    dense: np.ndarray
    lengths: np.ndarray
    values: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])


def check_content_type(content_type: str | bytes | None) -> str:
    """The media type the body is decoded as: JSON_MEDIA_TYPE or BINARY_MEDIA_TYPE.

    JSON: ``application/json`` (charset utf-8 only) or no Content-Type at all. Binary:
    ``application/x-dlrm-columnar`` without parameters. Media types compare
    case-insensitively (RFC 9110).

    Raises:
        UnsupportedMediaType: any other Content-Type (415), naming the ones to send.
    """
    if isinstance(content_type, (bytes, bytearray)):
        content_type = content_type.decode("latin-1")
    raw = (content_type or "").strip()
    parts = [p.strip().lower() for p in raw.split(";")]
    mime = parts[0]
    if mime == BINARY_MEDIA_TYPE and len(parts) == 1:
        return BINARY_MEDIA_TYPE
    charset_ok = all(not p.startswith("charset=") or p.strip('"') in ("charset=utf-8", 'charset="utf-8')
                     for p in parts[1:])
    if mime not in _JSON_TYPES or not charset_ok:
        raise UnsupportedMediaType(
            f"Content-Type {raw!r} is not supported; send the body as JSON with "
            "'Content-Type: application/json' (charset utf-8), or binary columnar with "
            f"'Content-Type: {BINARY_MEDIA_TYPE}'")
    return JSON_MEDIA_TYPE


def check_route_key(key: str | None) -> str | None:
    """A request's ``X-DLRM-Route-Key`` value, checked: None (no header) or 1 to
    ``ROUTE_KEY_MAX_CHARS`` characters.

    Raises:
        InvalidInput: an empty or too long key (400), naming the header and the rule.
    """
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is a {type(key).__name__}; send text "
                           f"of 1 to {ROUTE_KEY_MAX_CHARS} characters")
    if not key:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: is empty; send 1 to "
                           f"{ROUTE_KEY_MAX_CHARS} characters (e.g. a user or session id), or "
                           "leave the header out")
    if len(key) > ROUTE_KEY_MAX_CHARS:
        raise InvalidInput(f"header {ROUTE_KEY_HEADER}: has {len(key)} characters; at most "
                           f"{ROUTE_KEY_MAX_CHARS} are allowed; send a shorter key (e.g. a hash "
                           "of the user id) or leave the header out")
    return key


def _check_size(size: int, cfg: HandlerConfig) -> None:
    if size > cfg.max_body_bytes:
        raise PayloadTooLarge(
            f"body is {size} bytes; the limit is {cfg.max_body_bytes} bytes; "
            "split the instances over several requests")


def _json_type(v: Any) -> str:
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


def _not_a(v: Any, what: str) -> str:
    """'"abc" is a string, not a number' / 'null is not a number'."""
    if v is None:
        return f"null is not a{'n' if what[0] in 'aeiou' else ''} {what}"
    return f"{_show(v)} is a {_json_type(v)}, not a{'n' if what[0] in 'aeiou' else ''} {what}"


def _show(v: Any) -> str:
    """A value as JSON text, cut short (messages must stay small)."""
    try:
        s = orjson.dumps(v).decode()
    except TypeError:
        s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _id_problem(v: Any) -> str | None:
    t = type(v)
    if t is int:
        if v < 0:
            return f"{v} is negative; ids must be integers >= 0"
        if v > INT64_MAX:
            return f"{v} is greater than 2^63-1 ({INT64_MAX}); {_ID_RULE}"
        return None
    if t is float:
        if v.is_integer() and abs(v) > INT64_MAX:
            return f"{_show(v)} is beyond the 64-bit integer range; {_ID_RULE}"
        return f"{_show(v)} is not an integer; {_ID_RULE} (no decimal point or exponent)"
    return f"{_not_a(v, 'integer')}; {_ID_RULE}"


def _cap_rule(caps: _Caps, f: int, spec: _Spec) -> str:
    """Why feature ``f`` may carry no more ids, as the tail of a message."""
    cap = int(caps.arr[f])
    if caps.by_model[f]:
        return (f"the model accepts at most {cap} id{'s' if cap != 1 else ''} in "
                f"{spec.names[f]} (its max_ids); drop or hash the extra ids")
    return f"at most {cap} ids per feature are allowed; drop or hash the extra ids"


def _example_arrays(n: int, seed: int, max_id: int, spec: _Spec, multi_hot: bool
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
