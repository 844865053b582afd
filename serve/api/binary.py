"""The binary columnar form of a predict request: ``Content-Type: application/x-dlrm-columnar``.

No JSON decoding at all: for high-throughput clients with large requests; build it with
:func:`encode_binary` (B, F, N as in :mod:`serve.api.request`). Little-endian, no
padding::

      offset          size      field
      0               4         magic b"DLRM"
      4               4         uint32 version = 1
      8               4         uint32 B  (instances, 1..max_instances)
      12              4         uint32 F  (must be the model's F: 26 built in)
      16              4         uint32 N  (must be the model's N: 13 built in)
      20              4*B*N     dense   float32 (B, N) row-major
      20+4BN          4*F*B     lengths int32 (F, B) feature-major: ids of feature f, sample b
      20+4BN+4FB      8*nnz     values  int64 (nnz,) feature-major, nnz = sum(lengths)

Version 2, the ranking form (features shared by every candidate sent once, as the JSON
``context``; :func:`encode_binary_ranking`): after the same 20 bytes (version = 2,
B = candidates)::

      20              4         uint32 dense part: 1 = context (one row), 0 = per candidate
      24              P         uint8 part of each feature: 1 = context, 0 = per candidate,
                                zero-padded to P = F rounded up to a multiple of 4
      24+P            4*R*N     dense float32 (R, N): R = 1 in the context, else B
      ...             4*L       lengths int32: per feature in order, 1 for a context feature
                                (its ids, shared), B for a candidate feature
      ...             8*nnz     values int64 feature-major, a context feature's ids once

The version-1 body must be exactly ``20 + 4*B*N + 4*F*B + 8*nnz`` bytes. It is read with
``numpy.frombuffer`` (views into the body where it is writable and aligned, as the
bytearray TorchServe hands over is; copies otherwise) into the same
:class:`~serve.api.request.ParsedRequest` the JSON forms give, so merging, the forward
and the response are shared. Rules as for JSON: B >= 1 (more than ``max_instances`` ->
413), lengths in [0, the feature's cap], ids >= 0, dense finite. ``values`` starts 8-byte
aligned only when 20 + 4*B*(N+F) is a multiple of 8 (built in: odd B); otherwise it is
copied (a memcpy: 3 us for the 13k ids of 512 one-hot instances, whose whole parse takes
~35 us). Not worth it for a few instances per request, where decoding is not the limit:
use JSON there (readable, curl-able). :func:`parse_binary` decodes a body
(:mod:`serve.api.decode` calls it after the size check).
"""
from __future__ import annotations

import numpy as np

from serve.api.config import HandlerConfig
from serve.api.request import INT64_MAX, JSON_MEDIA_TYPE, ParsedRequest
from serve.api.spec import DEFAULT_SPEC, Spec, cap_rule, example_arrays, id_problem, spec_of
from serve.errors import InvalidInput, PayloadTooLarge
from serve.schema import ModelSchema

__all__ = ["BINARY_VERSION", "RANKING_VERSION", "encode_binary", "encode_binary_ranking",
           "example_binary", "parse_binary"]


BINARY_VERSION = 1
#: The ranking form: a context (features shared by every candidate) sent once.
RANKING_VERSION = 2
_MAGIC = b"DLRM"
# magic, then uint32 version, B, F, N; little-endian
_HEADER = np.dtype([("magic", "S4"), ("version", "<u4"), ("b", "<u4"), ("f", "<u4"),
                    ("n", "<u4")])
_HEADER_BYTES = _HEADER.itemsize  # 20
_BINARY_DENSE_RULE = "dense values must be finite"
_LENGTH_RULE = "lengths must be integers >= 0"


def _binary_array(buf: memoryview, dtype: str, count: int, offset: int) -> np.ndarray:
    """``count`` items of little-endian ``dtype`` at ``offset``, as a native-endian array.

    A view into ``buf`` when that is writable and aligned (the bytearray TorchServe hands
    over); otherwise a copy, so every ParsedRequest is writable and aligned whatever the
    source (``torch.from_numpy`` warns on read-only arrays).
    """
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    native = arr.astype(np.dtype(dtype).newbyteorder("="), copy=False)  # no-op on LE hosts
    if native is arr and (not arr.flags.writeable or not arr.flags.aligned):
        native = arr.copy()
    return native


def parse_binary(body: bytes | bytearray | memoryview, cfg: HandlerConfig,
                 spec: Spec = DEFAULT_SPEC) -> ParsedRequest:
    """The binary columnar form (layout in the module docstring) -> ParsedRequest; F and
    N must be ``spec``'s schema's."""
    buf = memoryview(body).cast("B")
    size = buf.nbytes
    if size < _HEADER_BYTES:
        raise InvalidInput(f"binary body: is {size} bytes; the header needs {_HEADER_BYTES} "
                           "bytes (magic b'DLRM', then uint32 version, B, F, N, little-endian)")
    head = np.frombuffer(buf, dtype=_HEADER, count=1)[0]
    magic = bytes(buf[:4])
    if magic != _MAGIC:
        raise InvalidInput(f"binary body: magic is {magic!r}; expected {_MAGIC!r} as the "
                           f"first 4 bytes (JSON bodies need 'Content-Type: {JSON_MEDIA_TYPE}')")
    version, b, nf, nd = (int(head[k]) for k in ("version", "b", "f", "n"))
    if version not in (BINARY_VERSION, RANKING_VERSION):
        raise InvalidInput(f"binary body: version is {version}; versions {BINARY_VERSION} "
                           f"(instances) and {RANKING_VERSION} (ranking: a context) are "
                           "supported")
    if nf != spec.nf:
        raise InvalidInput(f"binary body: F is {nf}; it must be {spec.nf} "
                           f"({spec.names_text})")
    if nd != spec.nd:
        raise InvalidInput(f"binary body: N is {nd}; it must be {spec.nd} (the model's dense "
                           "features)")
    if b == 0:
        raise InvalidInput(f"binary body: B is 0; send 1 to {cfg.max_instances} instances")
    if b > cfg.max_instances:
        raise PayloadTooLarge(
            f"binary body: B={b} instances exceed the limit of {cfg.max_instances} per request; "
            "split them over several requests")
    dense_at, dense_shared = _HEADER_BYTES, False
    shared: tuple[int, ...] = ()
    if version == RANKING_VERSION:
        dense_at, shared, dense_shared = _ranking_header(buf, nf, spec)
    dense_rows = 1 if dense_shared else b
    lengths_at = dense_at + 4 * dense_rows * nd
    entries = (nf - len(shared)) * b + len(shared)   # a context feature: one length
    values_at = lengths_at + 4 * entries
    if size < values_at:
        raise InvalidInput(f"binary body: is {size} bytes; the header (B={b}) needs at least "
                           f"{values_at} bytes for dense and lengths; send the whole body")
    lengths = _binary_array(buf, "<i4", entries, lengths_at)
    lengths = lengths.reshape(nf, b) if not shared else _spread(lengths, shared, nf, b)
    if int(lengths.min()) < 0:
        f, s = map(int, np.argwhere(lengths < 0)[0])
        raise InvalidInput(f"binary body: lengths[{spec.names[f]}][{s}] is "
                           f"{int(lengths[f, s])}; {_LENGTH_RULE}")
    caps = spec.caps(cfg.max_ids_per_feature)
    over = caps.exceeded(lengths) if int(lengths.max()) > caps.lo else None
    if over is not None:
        f, s = map(int, np.argwhere(over)[0])
        raise InvalidInput(f"binary body: lengths[{spec.names[f]}][{s}] is "
                           f"{int(lengths[f, s])}; {cap_rule(caps, f, spec)}")
    nnz = int(lengths.sum(dtype=np.int64))
    want = values_at + 8 * nnz
    if size != want:
        raise InvalidInput(f"binary body: is {size} bytes; the header (B={b}, nnz={nnz}) needs "
                           f"{want} bytes; nnz is the sum of lengths and each id is 8 bytes")
    dense = _binary_array(buf, "<f4", dense_rows * nd, dense_at).reshape(dense_rows, nd)
    finite = np.isfinite(dense)
    if not finite.all():
        i, j = map(int, np.argwhere(~finite)[0])
        raise InvalidInput(f"binary body: dense[{i}][{j}] is {float(dense[i, j])!r}; "
                           f"{_BINARY_DENSE_RULE}")
    values = _binary_array(buf, "<i8", nnz, values_at)
    if nnz and int(values.min()) < 0:
        k = int(np.argmax(values < 0))
        ends = np.cumsum(lengths.reshape(-1), dtype=np.int64)
        f, s = divmod(int(np.searchsorted(ends, k, side="right")), b)
        raise InvalidInput(f"binary body: values[{k}] ({spec.names[f]}, sample {s}): "
                           f"{id_problem(int(values[k]))}")
    if dense_shared:
        dense = np.repeat(dense, b, axis=0)
    return ParsedRequest(dense, lengths, values, shared if b > 1 else ())


def _ranking_header(buf: memoryview, nf: int, spec: Spec) -> tuple[int, tuple[int, ...], bool]:
    """Version 2's header after the common 20 bytes: (where dense starts, the context's
    features, whether dense is in the context)."""
    at = _HEADER_BYTES + 4 + _pad4(nf)
    if buf.nbytes < at:
        raise InvalidInput(f"binary body: is {buf.nbytes} bytes; a version {RANKING_VERSION} "
                           f"header with F={nf} needs {at} bytes (uint32 dense part, then one "
                           "byte per feature: 0 candidates, 1 context)")
    flag = int(np.frombuffer(buf, dtype="<u4", count=1, offset=_HEADER_BYTES)[0])
    parts = np.frombuffer(buf, dtype=np.uint8, count=nf, offset=_HEADER_BYTES + 4)
    if flag > 1 or int(parts.max(initial=0)) > 1:
        raise InvalidInput(f"binary body: parts are {flag} (dense) and "
                           f"{sorted(set(parts.tolist()))} (features); each must be 0 "
                           "(per candidate) or 1 (context)")
    shared = tuple(int(f) for f in np.flatnonzero(parts))
    if flag and len(shared) == nf:
        raise InvalidInput("binary body: the context holds every feature (dense and sparse), "
                           "so all candidates would be the same instance; send at least one "
                           "feature per candidate, or send one instance")
    return at, shared, bool(flag)


def _spread(compact: np.ndarray, shared: tuple[int, ...], nf: int, b: int) -> np.ndarray:
    """Version 2's lengths (a context feature's one length, a candidate feature's B) ->
    int32 (F, B), a context feature's length in sample 0's cell, 0 elsewhere."""
    full = np.zeros((nf, b), dtype=np.int32)
    at = 0
    ctx = set(shared)
    for f in range(nf):
        if f in ctx:
            full[f, 0] = compact[at]
            at += 1
        else:
            full[f] = compact[at:at + b]
            at += b
    return full


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def encode_binary(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray, *,
                  schema: ModelSchema | None = None) -> bytes:
    """One binary columnar body (``Content-Type: application/x-dlrm-columnar``).

    Args:
        dense: (B, N) numbers, sent as float32 (float64 is rounded like the JSON path).
        lengths: (F, B) integers: ids of feature f for sample b, feature-major.
        values: (nnz,) integer ids in [0, 2^63-1], feature-major (the first feature's ids
            of samples 0..B-1, then the second's ...); nnz = lengths.sum().
        schema: the model's schema, whose N and F the arrays must have (the features in
            ``schema.feature_names`` order); None: :data:`DEFAULT_SCHEMA` (N=13, F=26).
    Returns:
        ``20 + 4*B*N + 4*F*B + 8*nnz`` bytes (layout in the module docstring).
    Raises:
        ValueError: shapes or integer types off, a negative length, or values.size !=
            lengths.sum(). The server checks the rest (negative ids, non-finite dense,
            limits), so this can build bodies it rejects.

    Example::

        body = encode_binary(np.zeros((2, 13), np.float32), np.ones((26, 2), np.int32),
                             np.arange(52, dtype=np.int64))
        httpx.post(url, content=body, headers={"Content-Type": BINARY_MEDIA_TYPE})
    """
    d = np.asarray(dense)
    ln = np.asarray(lengths)
    v = np.asarray(values)
    spec = spec_of(schema)
    nf, nd = spec.nf, spec.nd
    if d.ndim != 2 or d.shape[1] != nd:
        raise ValueError(f"dense has shape {d.shape}; it must be (B, {nd})")
    b = d.shape[0]
    if ln.shape != (nf, b):
        raise ValueError(f"lengths has shape {ln.shape}; it must be ({nf}, B={b}), feature-major")
    if v.ndim != 1:
        raise ValueError(f"values has shape {v.shape}; it must be 1-d (nnz,)")
    for name, a in (("lengths", ln), ("values", v)):
        if a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name} has dtype {a.dtype}; it must hold integers")
    if ln.size and (int(ln.min()) < 0 or int(ln.max()) >= 2**31):
        raise ValueError(f"lengths must be in [0, 2^31-1]; got {int(ln.min())}..{int(ln.max())}")
    if v.size and v.dtype.kind == "u" and int(v.max()) > INT64_MAX:
        raise ValueError(f"values: {int(v.max())} is greater than 2^63-1; ids must fit int64")
    nnz = int(ln.sum(dtype=np.int64)) if ln.size else 0
    if v.size != nnz:
        raise ValueError(f"values has {v.size} ids but lengths sum to {nnz}; they must be equal")
    head = np.array([(_MAGIC, BINARY_VERSION, b, nf, nd)], dtype=_HEADER)
    return b"".join((head.tobytes(), d.astype("<f4").tobytes(), ln.astype("<i4").tobytes(),
                     v.astype("<i8").tobytes()))


def encode_binary_ranking(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray,
                          shared: tuple[int, ...], *, dense_shared: bool,
                          schema: ModelSchema | None = None) -> bytes:
    """One version-2 (ranking) body: ``shared`` features (indices in the schema's order)
    sent once, and the dense vector once when ``dense_shared``.

    Args:
        dense: (1, N) when ``dense_shared``, else (B, N).
        lengths: (F, B) as a decoded ranking request holds them: a context feature's ids
            counted in sample 0's cell, 0 in the others (:class:`ParsedRequest`).
        values: (nnz,) feature-major, a context feature's ids once.
    Raises:
        ValueError: shapes off, or a context feature with ids outside sample 0's cell.
    """
    spec = spec_of(schema)
    ln = np.asarray(lengths)
    d = np.asarray(dense)
    nf, b = ln.shape
    if nf != spec.nf or d.ndim != 2 or d.shape != ((1 if dense_shared else b), spec.nd):
        raise ValueError(f"dense {d.shape} / lengths {ln.shape} do not fit F={spec.nf}, "
                         f"N={spec.nd}, B={b} (dense (1, N) when shared)")
    if any(ln[f, 1:].any() for f in shared):
        raise ValueError("a context feature's ids must all be counted in sample 0's cell")
    body = encode_binary(np.zeros((b, spec.nd)), ln, values, schema=schema)  # checks the rest
    parts = np.zeros(_pad4(nf), dtype=np.uint8)
    parts[list(shared)] = 1
    compact = np.concatenate([ln[f, :1] if f in set(shared) else ln[f] for f in range(nf)])
    head = np.array([(_MAGIC, RANKING_VERSION, b, nf, spec.nd)], dtype=_HEADER)
    nnz_bytes = 8 * int(ln.sum(dtype=np.int64))
    return b"".join((head.tobytes(), np.array([int(dense_shared)], "<u4").tobytes(),
                     parts.tobytes(), d.astype("<f4").tobytes(),
                     compact.astype("<i4").tobytes(), body[len(body) - nnz_bytes:]))


def example_binary(n: int = 1, *, seed: int = 0, max_id: int = 2**31,
                   schema: ModelSchema | None = None, multi_hot: bool = False) -> bytes:
    """The instances of ``example_request(n, seed=seed, max_id=max_id, schema=schema,
    multi_hot=multi_hot)`` as a binary body.

    Parses to exactly the same ParsedRequest as the JSON forms (send it with
    ``Content-Type: application/x-dlrm-columnar``).
    """
    spec = spec_of(schema)
    dense, lengths, ids = example_arrays(n, seed, max_id, spec, multi_hot)
    return encode_binary(dense, lengths, ids, schema=schema)
