"""The two JSON forms of a predict request: rows and columnar.

Both are answered with ``{"predictions": [p_0, ..., p_{B-1}]}``. For the built-in schema
(:mod:`serve.api.request` defines B, F, N and the rules):

* rows::

      {"instances": [{"dense": [13 numbers], "sparse": {"C1": [ids], ..., "C26": [ids]}}, ...]}

* columnar (no per-instance objects: ~30% smaller and faster to parse)::

      {"dense": [[13 numbers], ...B rows],
       "sparse": {"C1": {"values": [ids...], "lengths": [B ints]}, ..., "C26": {...}}}

  ``lengths[b]`` ids of ``values`` belong to sample b, in order.

Ids are JSON integers in [0, 2^63-1], parsed exactly (orjson keeps 64-bit integers;
nothing goes through float). Dense values are finite JSON numbers that fit float32.

A body is decoded by orjson, then by the fast path (``_fast_parse``: proves the common
valid body in few passes) and, for anything it cannot prove, by the validating parse
(``parse_doc``), the one place errors and their wording come from.
:func:`parse_json_body` runs both (``load_json``, then the fast path, then
:func:`parse_doc`); :mod:`serve.api.decode` calls it inside :class:`gc_paused`.
:func:`example_request` builds valid bodies.
"""
from __future__ import annotations

import gc
import operator
import struct
from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np
import orjson

from serve.api.config import HandlerConfig
from serve.api.request import ParsedRequest
from serve.api.spec import (
    DEFAULT_SPEC,
    ID_RULE,
    Caps,
    Spec,
    cap_rule,
    check_size,
    example_arrays,
    id_problem,
    json_type,
    not_a,
    show,
    spec_of,
)
from serve.errors import InvalidInput, PayloadTooLarge
from serve.schema import ModelSchema

__all__ = ["dense_matrix", "example_request", "fast_columnar", "fast_rows", "gc_paused",
           "ids_array", "load_json", "parse_columnar", "parse_doc", "parse_doc_fast",
           "parse_json_body", "parse_rows"]


_F32_MAX = float(np.finfo(np.float32).max)
_INSTANCE_KEYS = frozenset(("dense", "sparse"))
_SPARSE_ONLY = frozenset(("sparse",))
_COLUMN_KEYS = frozenset(("values", "lengths"))
_DENSE_RULE = "dense values must be finite JSON numbers within float32 range"


class gc_paused:  # lower case: used like a function, ``with gc_paused():``
    """Pause Python's cyclic garbage collector while a request is decoded.

    A 512-instance body becomes ~15k lists and dicts; every 700 container allocations
    the collector runs, and its older generations walk the whole heap (torch's objects
    included). Measured on a 2-core host: handling two 512-instance requests cost 44 ms
    of CPU with the collector on and 26 ms with it paused. JSON trees hold no cycles, so
    reference counting frees them anyway. Process-wide: the worker is single-threaded.
    A class, not a ``@contextmanager`` generator: 0.4 us instead of 2 us a request.
    """

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            gc.enable()


def parse_json_body(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig,
                    spec: Spec = DEFAULT_SPEC) -> ParsedRequest:
    """One JSON body (rows or columnar) -> ParsedRequest (dense float32 (B, N), lengths
    int32 (F, B), values int64 (nnz,) feature-major), validated against ``spec``.

    Raises:
        PayloadTooLarge: over ``cfg.max_body_bytes`` or ``cfg.max_instances``.
        InvalidInput: anything else wrong, with the field path in the message.
    """
    return parse_doc_fast(load_json(body, cfg), cfg, spec)


def parse_doc_fast(doc: Any, cfg: HandlerConfig, spec: Spec = DEFAULT_SPEC) -> ParsedRequest:
    """A decoded rows or columnar body -> ParsedRequest: the fast path, else the validating
    parse."""
    # The common valid body takes the fast path; anything it does not prove valid goes
    # through the validating parse, which raises the precise error (or accepts it).
    parsed = _fast_parse(doc, cfg, spec)
    return parsed if parsed is not None else parse_doc(doc, cfg, spec)


def load_json(body: bytes | bytearray | memoryview | str, cfg: HandlerConfig) -> Any:
    """The body's JSON value (size and syntax checked; nothing else)."""
    size = len(body)
    check_size(size, cfg)
    if size == 0:
        raise InvalidInput("body is empty; send a JSON object "
                           '{"instances": [...]} or {"dense": [...], "sparse": {...}}')
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"body is not valid JSON ({e}); send UTF-8 JSON (NaN and Infinity "
                           "are not JSON numbers)") from None


def parse_doc(doc: Any, cfg: HandlerConfig, spec: Spec = DEFAULT_SPEC) -> ParsedRequest:
    """The validating parse of a decoded body against ``spec``'s schema: checks every rule
    in order and raises the first violation with its field path. The reference for
    :func:`_fast_parse`."""
    if not isinstance(doc, dict):
        raise InvalidInput(
            f"body is a JSON {json_type(doc)}; expected an object "
            '{"instances": [...]} (rows) or {"dense": [...], "sparse": {...}} (columnar)')
    keys = set(doc)
    if "instances" in doc:
        if keys != {"instances"}:
            raise InvalidInput(f"body: unknown keys {sorted(keys - {'instances'})} next to "
                               '"instances"; the row form has only "instances"')
        return parse_rows(doc["instances"], cfg, spec)
    if keys == {"dense", "sparse"}:
        return parse_columnar(doc["dense"], doc["sparse"], cfg, spec)
    raise InvalidInput(
        f"body has keys {sorted(keys)}; expected {{\"instances\": [...]}} (rows), "
        '{"dense": [...], "sparse": {...}} (columnar) or {"context": {...}, '
        '"candidates": [...]} (ranking)')


def _check_count(n: int, what: str, cfg: HandlerConfig) -> None:
    if n == 0:
        raise InvalidInput(f"{what}: is empty; send 1 to {cfg.max_instances} instances")
    if n > cfg.max_instances:
        raise PayloadTooLarge(
            f"{what}: {n} instances exceed the limit of {cfg.max_instances} per request; "
            "split them over several requests")


def dense_matrix(rows: Any, path: Callable[[int], str], nd: int) -> np.ndarray:
    """list of B lists of N = ``nd`` numbers -> float32 (B, N), or InvalidInput naming the
    cell."""
    types = set(map(type, rows))
    if types != {list}:
        for i, r in enumerate(rows):
            if not isinstance(r, list):
                raise InvalidInput(f"{path(i)}: is a JSON {json_type(r)}; expected an array "
                                   f"of {nd} numbers (the model's dense features)")
    lens = set(map(len, rows))
    if lens != {nd}:
        for i, r in enumerate(rows):
            if len(r) != nd:
                raise InvalidInput(f"{path(i)}: has {len(r)} values; it must have exactly "
                                   f"{nd} (the model's dense features)")
    cell_types = set(map(type, chain.from_iterable(rows)))
    if not cell_types <= {int, float}:
        for i, r in enumerate(rows):
            for j, v in enumerate(r):
                if type(v) not in (int, float):
                    raise InvalidInput(f"{path(i)}[{j}]: {not_a(v, 'number')}; {_DENSE_RULE}")
    try:
        wide = np.array(rows, dtype=np.float64)
    except OverflowError:  # an integer beyond float64: cannot happen via orjson, kept safe
        wide = np.array([[float(v) for v in r] for r in rows], dtype=np.float64)
    wide = wide.reshape(len(rows), nd)  # (B, 0) when the model has no dense features
    bad = ~(np.abs(wide) <= _F32_MAX)  # also catches NaN (comparison is False)
    if bad.any():
        i, j = map(int, np.argwhere(bad)[0])
        raise InvalidInput(f"{path(i)}[{j}]: {show(rows[i][j])} is outside float32 range; "
                           f"{_DENSE_RULE}")
    return wide.astype(np.float32)


def ids_array(vals: list[Any], where: Callable[[int], str]) -> np.ndarray:
    """Flat list of ids -> int64 (nnz,), or InvalidInput naming the first bad id.

    ``where(k)`` returns the field path of flat position k (only called on errors).
    """
    if not vals:
        return np.zeros(0, dtype=np.int64)
    if set(map(type, vals)) == {int}:
        try:
            arr = np.array(vals, dtype=np.int64)
        except OverflowError:
            arr = None
        if arr is not None and arr.min() >= 0:
            return arr
    for k, v in enumerate(vals):  # slow path: find and describe the first offender
        msg = id_problem(v)
        if msg:
            raise InvalidInput(f"{where(k)}: {msg}")
    raise InvalidInput(f"{where(0)}: ids are invalid; {ID_RULE}")  # unreachable in practice


def _lengths_cap(lengths: np.ndarray, caps: Caps, spec: Spec,
                 where: Callable[[int, int], str]) -> None:
    """lengths (F, B): every entry within its feature's cap, else InvalidInput at (f, b)."""
    over = caps.exceeded(lengths)
    if over is not None:
        f, b = map(int, np.argwhere(over)[0])
        raise InvalidInput(f"{where(f, b)}: has {int(lengths[f, b])} ids; "
                           f"{cap_rule(caps, f, spec)}")


def parse_rows(instances: Any, cfg: HandlerConfig, spec: Spec, *, root: str = "instances",
                with_dense: bool = True,
                feature_error: Callable[[str, set[str], Spec], None] | None = None
                ) -> ParsedRequest:
    """The row form's validating parse. ``root``: the array's name in messages;
    ``with_dense``: each object carries ``dense`` (else dense is (B, 0)); ``feature_error``:
    raises for an object whose sparse keys are not ``spec``'s (default: names the missing
    and unknown features)."""
    keys = _INSTANCE_KEYS if with_dense else _SPARSE_ONLY
    shape = '{"dense": [...], "sparse": {...}}' if with_dense else '{"sparse": {...}}'
    if not isinstance(instances, list):
        raise InvalidInput(f"{root}: is a JSON {json_type(instances)}; expected an array "
                           f"of objects {shape}")
    n = len(instances)
    _check_count(n, root, cfg)
    if set(map(type, instances)) != {dict}:
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise InvalidInput(f"{root}[{i}]: is a JSON {json_type(inst)}; expected an "
                                   f"object {shape}")
    for i, inst in enumerate(instances):
        if inst.keys() != keys:
            _key_error(f"{root}[{i}]", set(inst), keys)
    sparse = [inst["sparse"] for inst in instances]
    names = spec.names
    # Feature names before the dense values: a body meant for another model is told which
    # features this one takes, not only that its dense count is off.
    for i, sp in enumerate(sparse):
        if not isinstance(sp, dict):
            raise InvalidInput(f"{root}[{i}].sparse: is a JSON {json_type(sp)}; expected an "
                               f"object {spec.sparse_example('[ids]')}")
        if sp.keys() != spec.name_set:
            (feature_error or _feature_error)(f"{root}[{i}].sparse", set(sp), spec)
    dense = (dense_matrix([inst["dense"] for inst in instances],
                           lambda i: f"{root}[{i}].dense", spec.nd) if with_dense
             else np.zeros((n, 0), dtype=np.float32))
    # per_feature[f][b]: the id list of feature f for instance b (F x B)
    per_feature = [[sp[f] for sp in sparse] for f in names]
    cells = list(chain.from_iterable(per_feature))
    if set(map(type, cells)) != {list}:
        for k, c in enumerate(cells):
            if not isinstance(c, list):
                f, b = divmod(k, n)
                raise InvalidInput(f"{root}[{b}].sparse.{names[f]}: is a JSON "
                                   f"{json_type(c)}; expected an array of ids, e.g. [42]")
    lengths = np.fromiter(map(len, cells), dtype=np.int32, count=len(cells)).reshape(spec.nf, n)
    _lengths_cap(lengths, spec.caps(cfg.max_ids_per_feature), spec,
                 lambda f, b: f"{root}[{b}].sparse.{names[f]}")
    flat = list(chain.from_iterable(cells))

    def where(k: int) -> str:
        ends = np.cumsum(lengths.reshape(-1))
        cell = int(np.searchsorted(ends, k, side="right"))
        f, b = divmod(cell, n)
        start = int(ends[cell - 1]) if cell else 0
        return f"{root}[{b}].sparse.{names[f]}[{k - start}]"

    values = ids_array(flat, where)
    return ParsedRequest(dense, lengths, values)


def parse_columnar(dense_rows: Any, sparse: Any, cfg: HandlerConfig, spec: Spec, *,
                    root: str = "", rows: int | None = None,
                    feature_error: Callable[[str, set[str], Spec], None] | None = None
                    ) -> ParsedRequest:
    """The columnar form's validating parse. ``root``: prefix of every path in messages;
    ``dense_rows`` None: no dense part (dense is (B, 0)) and B = ``rows``;
    ``feature_error`` as in :func:`parse_rows`."""
    if dense_rows is None:
        n = int(rows or 0)
        _check_count(n, f"{root}sparse.{spec.names[0]}.lengths", cfg)
    else:
        if not isinstance(dense_rows, list):
            raise InvalidInput(f"{root}dense: is a JSON {json_type(dense_rows)}; expected an "
                               f"array of B arrays of {spec.nd} numbers")
        n = len(dense_rows)
        _check_count(n, f"{root}dense", cfg)
    # Feature names before the dense values, as in the row form.
    if not isinstance(sparse, dict):
        raise InvalidInput(f"{root}sparse: is a JSON {json_type(sparse)}; expected an object "
                           f'{{"{spec.names[0]}": {{"values": [...], "lengths": [...]}}, ...}}')
    if sparse.keys() != spec.name_set:
        (feature_error or _feature_error)(f"{root}sparse", set(sparse), spec)
    dense = (np.zeros((n, 0), dtype=np.float32) if dense_rows is None
             else dense_matrix(dense_rows, lambda i: f"{root}dense[{i}]", spec.nd))
    caps = spec.caps(cfg.max_ids_per_feature)
    lengths = np.empty((spec.nf, n), dtype=np.int32)
    chunks: list[np.ndarray] = []
    for fi, f in enumerate(spec.names):
        col = sparse[f]
        p = f"{root}sparse.{f}"
        if not isinstance(col, dict):
            raise InvalidInput(f"{p}: is a JSON {json_type(col)}; expected an object "
                               '{"values": [ids...], "lengths": [B counts]}')
        if col.keys() != _COLUMN_KEYS:
            _key_error(p, set(col), _COLUMN_KEYS)
        lens, vals = col["lengths"], col["values"]
        for name, v in (("lengths", lens), ("values", vals)):
            if not isinstance(v, list):
                raise InvalidInput(f"{p}.{name}: is a JSON {json_type(v)}; expected an array")
        if len(lens) != n:
            raise InvalidInput(f"{p}.lengths: has {len(lens)} entries; it must have one per "
                               f"{'dense row' if dense_rows is not None else 'candidate'} ({n})")
        if set(map(type, lens)) != {int} or min(lens) < 0:
            for b, v in enumerate(lens):
                if type(v) is not int or v < 0:
                    raise InvalidInput(f"{p}.lengths[{b}]: {show(v)} is not a count; lengths "
                                       "must be integers >= 0")
        cap = int(caps.arr[fi])
        if max(lens) > cap:
            b = next(b for b, v in enumerate(lens) if v > cap)
            raise InvalidInput(f"{p}.lengths[{b}]: has {lens[b]} ids; "
                               f"{cap_rule(caps, fi, spec)}")
        total = sum(lens)
        if total != len(vals):
            raise InvalidInput(f"{p}: lengths sum to {total} but values has {len(vals)} ids; "
                               "they must be equal")
        lengths[fi] = lens
        chunks.append(ids_array(vals, _values_path(p)))
    values = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return ParsedRequest(dense, lengths, values)


def _values_path(p: str) -> Callable[[int], str]:
    return lambda k: f"{p}.values[{k}]"


def _key_error(path: str, got: set[str], want: frozenset[str]) -> None:
    missing, unknown = sorted(want - got), sorted(got - want)
    parts = []
    if missing:
        parts.append(f"missing keys {missing}")
    if unknown:
        parts.append(f"unknown keys {unknown}")
    raise InvalidInput(f"{path}: {'; '.join(parts)}; expected exactly {sorted(want)}")


def _feature_error(path: str, got: set[str], spec: Spec) -> None:
    """Name the missing and unknown features at ``path`` and list the model's, in order."""
    missing = [f for f in spec.names if f not in got]
    unknown = sorted(map(str, got - spec.name_set))
    parts = []
    if missing:
        parts.append(f"missing features {', '.join(missing)}")
    if unknown:
        parts.append(f"unknown features {', '.join(unknown)}")
    raise InvalidInput(f"{path}: {'; '.join(parts)}; every instance needs exactly the sparse "
                       f"features {spec.names_text} (an empty list [] for no ids)")


# ----------------------------------------------------------------------------- fast path
#
# The validating parse above walks the decoded JSON many times (type sets, per-instance
# key checks, F per-feature loops): ~4.7 ms of a 512-instance row body beside orjson's
# ~3.2 ms, and ~45 us of a 1-instance one. For a valid body the functions below prove the
# same rules in fewer passes and build bit-identical arrays. Whatever they cannot prove (a
# wrong shape, type, key or limit) makes them return None, and the validating parse runs
# from the start: errors and their wording come from one place only.

# What a malformed value raises inside the fast path (a missing key, a number where a
# list belongs, an id beyond int64): all mean "let the validating parse describe it".
_NOT_FAST = (KeyError, TypeError, ValueError, OverflowError)
# Lists up to this long are reduced (min/max) by Python's builtins: ~0.5 us against
# ~1.5 us per numpy reduction, whose fixed cost dominates a 1-instance request.
_PY_REDUCE_MAX = 64


def _fast_parse(doc: Any, cfg: HandlerConfig, spec: Spec = DEFAULT_SPEC
                ) -> ParsedRequest | None:
    """A valid body (either JSON form) for ``spec``'s schema -> its ParsedRequest, or None:
    not proven valid."""
    if type(doc) is not dict:
        return None
    try:
        if len(doc) == 1:
            return fast_rows(doc["instances"], cfg, spec)
        if len(doc) == 2:
            return fast_columnar(doc["dense"], doc["sparse"], cfg, spec)
    except _NOT_FAST:
        pass
    return None


def fast_rows(instances: Any, cfg: HandlerConfig, spec: Spec, with_dense: bool = True
               ) -> ParsedRequest | None:
    """The row form's ``instances`` -> ParsedRequest, or None (see :func:`_fast_parse`);
    ``with_dense`` as in :func:`parse_rows`."""
    if type(instances) is not list or not 0 < len(instances) <= cfg.max_instances:
        return None
    n = len(instances)
    # Two keys each (one without dense), and all looked up: exactly {dense, sparse} (a
    # non-object raises).
    if set(map(len, instances)) != {2 if with_dense else 1}:
        return None
    dense = (_fast_dense([inst["dense"] for inst in instances], n, spec.nd) if with_dense
             else np.zeros((n, 0), dtype=np.float32))
    sparse = [inst["sparse"] for inst in instances]
    nf = spec.nf
    # F keys each, and all F looked up: exactly the schema's features.
    if dense is None or set(map(len, sparse)) != {nf}:
        return None
    try:
        # One-hot (the usual DLRM request): every cell unpacks to exactly one item. A
        # non-list cell of one item yields a str (a character, an object key), which
        # _fast_ids refuses. Sample-major: one C-level gather per instance. One id is
        # within every cap (caps are >= 1).
        flat = [x for cells in map(spec.features_of, sparse) for [x] in cells]
    except (TypeError, ValueError):  # some cell is not one item: the general case
        return _fast_rows_multi_hot(dense, sparse, cfg, spec)
    values = _fast_ids(flat)
    if values is None:
        return None
    if n > 1:  # (B, F) sample-major -> (F, B) feature-major (a copy)
        values = values.reshape(n, nf).T.reshape(-1)
    return ParsedRequest(dense, np.ones((nf, n), dtype=np.int32), values)


def _fast_rows_multi_hot(dense: np.ndarray, sparse: list[Any], cfg: HandlerConfig, spec: Spec
                         ) -> ParsedRequest | None:
    """The row form with any number of ids per cell (``sparse``: B objects of F keys)."""
    n = len(sparse)
    cells = [sp[f] for f in spec.names for sp in sparse]  # (F*B) feature-major
    if not _all_of_type(cells, list):
        return None
    caps = spec.caps(cfg.max_ids_per_feature)
    if len(cells) <= _PY_REDUCE_MAX:
        lens = list(map(len, cells))
        if not _within_caps_py(lens, max(lens), caps, n):
            return None
        lengths = np.array(lens, dtype=np.int32).reshape(spec.nf, n)
    else:
        lengths = np.fromiter(map(len, cells), dtype=np.int32, count=len(cells))
        lengths = lengths.reshape(spec.nf, n)
        if not _within_caps(lengths, int(lengths.max()), caps):
            return None
    flat: list[Any] = []
    extend = flat.extend  # list.extend copies a list without an iterator: ~2x chain's speed
    for cell in cells:
        extend(cell)
    values = _fast_ids(flat)
    if values is None:
        return None
    return ParsedRequest(dense, lengths, values)


def _within_caps(lengths: np.ndarray, top: int, caps: Caps) -> bool:
    """Whether lengths (F, B), whose max is ``top``, keeps every feature's cap: a scalar
    check unless ``top`` falls between the smallest and the largest cap."""
    if top <= caps.lo:
        return True
    if top > caps.hi:
        return False
    return not bool((lengths > caps.arr[:, None]).any())


def _within_caps_py(lens: list[int], top: int, caps: Caps, n: int) -> bool:
    """:func:`_within_caps` of a small request's lengths as a Python list (F*n,),
    feature-major: Python's reductions beat numpy's fixed cost there."""
    if top <= caps.lo:
        return True
    if top > caps.hi:
        return False
    return all(map(operator.le, lens, caps.per_cell(n)))


def fast_columnar(dense_rows: Any, sparse: Any, cfg: HandlerConfig, spec: Spec,
                   rows: int | None = None) -> ParsedRequest | None:
    """The columnar form -> ParsedRequest, or None (see :func:`_fast_parse`); ``dense_rows``
    None: no dense part, B = ``rows`` (as in :func:`parse_columnar`)."""
    dense: np.ndarray | None
    if dense_rows is None:
        n = int(rows or 0)
        if not 0 < n <= cfg.max_instances:
            return None
        dense = np.zeros((n, 0), dtype=np.float32)
    else:
        if type(dense_rows) is not list or not 0 < len(dense_rows) <= cfg.max_instances:
            return None
        n = len(dense_rows)
        dense = _fast_dense(dense_rows, n, spec.nd)
    nf = spec.nf
    if dense is None or type(sparse) is not dict or len(sparse) != nf:
        return None
    cols = spec.features_of(sparse)
    if set(map(len, cols)) != {2}:  # exactly {values, lengths}: both looked up below
        return None
    lens = [col["lengths"] for col in cols]
    vals = [col["values"] for col in cols]
    if (not _all_of_type(lens, list) or not _all_of_type(vals, list)
            or set(map(len, lens)) != {n}):
        return None
    lflat = list(chain.from_iterable(lens))
    if not _all_of_type(lflat, int):
        return None
    if lflat.count(1) == len(lflat):  # one-hot (ints, so 1 exactly): nothing to convert
        lengths = np.ones((nf, n), dtype=np.int32)
    else:
        lengths = np.array(lflat, dtype=np.int32).reshape(nf, n)  # OverflowError beyond int32
        caps = spec.caps(cfg.max_ids_per_feature)
        if len(lflat) <= _PY_REDUCE_MAX:
            if min(lflat) < 0 or not _within_caps_py(lflat, max(lflat), caps, n):
                return None
        elif int(lengths.min()) < 0 or not _within_caps(lengths, int(lengths.max()), caps):
            return None
    if lengths.sum(axis=1).tolist() != list(map(len, vals)):
        return None
    values = _fast_ids(list(chain.from_iterable(vals)))
    return None if values is None else ParsedRequest(dense, lengths, values)


def _all_of_type(items: list[Any], *types: type) -> bool:
    """Whether every item's exact type is one of ``types`` (so a bool is no int here).

    When all items have the first type (the usual case), one C-level pass and a count
    that compares type objects by identity: ~2/3 the cost of ``set(map(type, items))``.
    """
    found = list(map(type, items))
    return found.count(types[0]) == len(found) or set(found) <= set(types)


def _fast_dense(rows: list[Any], n: int, nd: int) -> np.ndarray | None:
    """B rows of N = ``nd`` numbers -> float32 (B, N) as :func:`dense_matrix` builds it,
    or None."""
    if set(map(len, rows)) != {nd}:
        return None
    flat = list(chain.from_iterable(rows))
    # Exact types: numpy would take a bool as 0/1 and parse a numeric string. (A non-list
    # row of N items yields str items too: characters or object keys.)
    if not _all_of_type(flat, float, int):
        return None
    if not flat:  # N = 0: every row is empty, and must be a list (not "" or {})
        return np.zeros((n, 0), dtype=np.float32) if all(type(r) is list for r in rows) else None
    # |v| <= float32 max, as dense_matrix checks it (NaN fails both ways).
    if len(flat) <= _PY_REDUCE_MAX:
        # Python compares an int with the bound exactly, numpy after rounding it to
        # float64: at worst a huge int falls back, never the other way round. numpy
        # converts to float32 through float64, as dense_matrix does in two steps.
        if not (min(flat) >= -_F32_MAX and max(flat) <= _F32_MAX):
            return None
        return np.array(flat, dtype=np.float32).reshape(n, nd)
    # struct packs Python numbers 2-3x faster than np.array converts them (45 against
    # 130 us for 512 rows); both convert an int as float(int) does.
    wide = np.frombuffer(struct.pack(f"{len(flat)}d", *flat), dtype=np.float64)
    if not (wide.min() >= -_F32_MAX and wide.max() <= _F32_MAX):
        return None
    return wide.astype(np.float32).reshape(n, nd)


def _fast_ids(flat: list[Any]) -> np.ndarray | None:
    """Flat ids -> int64 (nnz,) as :func:`ids_array` builds it, or None."""
    if not flat:
        return np.zeros(0, dtype=np.int64)
    if not _all_of_type(flat, int):  # exact: no bool, float or str
        return None
    small = len(flat) <= _PY_REDUCE_MAX
    if small and min(flat) < 0:
        return None
    # OverflowError beyond int64; fromiter: ~15% faster than np.array on 10k ints
    values = np.fromiter(flat, dtype=np.int64, count=len(flat))
    return values if small or values.min() >= 0 else None


def example_request(n: int = 1, *, seed: int = 0, form: str = "rows", max_id: int = 2**31,
                    schema: ModelSchema | None = None, multi_hot: bool = False
                    ) -> dict[str, Any]:
    """A valid request body (as a dict) of ``n`` random instances for ``schema``.

    For smoke tests, the launcher's readiness probe and benchmarks; ``form`` is
    "rows" or "columnar". :func:`example_binary` encodes the same instances as binary.

    Args:
        schema: the model's schema (N dense values, the F features by name); None:
            :data:`DEFAULT_SCHEMA`.
        multi_hot: False: one id per feature and instance (ids in [0, max_id)); True:
            0..``schema.max_ids[f]`` ids in feature f (valid when the handler's
            ``max_ids_per_feature`` is no lower).
    """
    spec = spec_of(schema)
    dense_arr, lengths_arr, ids_arr = example_arrays(n, seed, max_id, spec, multi_hot)
    dense, ids = dense_arr.tolist(), ids_arr.tolist()
    names = spec.names
    if form not in ("rows", "columnar"):
        raise ValueError(f"form {form!r} must be 'rows' or 'columnar'")
    if not multi_hot:
        if form == "rows":
            return {"instances": [
                {"dense": dense[b], "sparse": {f: [ids[fi * n + b]] for fi, f in enumerate(names)}}
                for b in range(n)]}
        return {"dense": dense, "sparse": {f: {"values": ids[fi * n:(fi + 1) * n],
                                               "lengths": [1] * n}
                                           for fi, f in enumerate(names)}}
    lengths = lengths_arr.tolist()
    ends = np.cumsum(lengths_arr.reshape(-1)).tolist()
    flat_lengths = lengths_arr.reshape(-1).tolist()
    cell = [ids[e - ln:e] for e, ln in zip(ends, flat_lengths, strict=True)]  # F*n
    if form == "rows":
        return {"instances": [
            {"dense": dense[b], "sparse": {f: cell[fi * n + b] for fi, f in enumerate(names)}}
            for b in range(n)]}
    return {"dense": dense, "sparse": {
        f: {"values": [x for b in range(n) for x in cell[fi * n + b]], "lengths": lengths[fi]}
        for fi, f in enumerate(names)}}
