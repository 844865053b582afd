"""Open Inference Protocol v2 (KServe v2) over HTTP: the protocol side, no HTTP framework.

The sidecar serves the protocol (:mod:`serve.sidecar.http.routes_oip`) and forwards each
infer to TorchServe's ``POST /predictions/{model}`` as our binary columnar body
(:func:`to_predict_body`), so batching, rollouts, headers and metrics are our API's. Here:
the model's metadata, parsing an infer request (JSON tensors and the binary-tensor
extension ``tritonclient`` uses) into the :class:`~serve.api.request.ParsedRequest` every
form of our API decodes into, and encoding the response.

Tensors (B instances, N dense features, F sparse features, as in :mod:`serve.api.request`):

* ``dense``: FP32 ``[B, N]`` (N = 13 for the built-in DLRM).
* each sparse feature (the schema's names: ``C1``..``C26`` built in): INT64. One id per
  instance: shape ``[B]``. Multi-hot: the ids of every instance, instance-major, shape
  ``[nnz]``, plus ``<feature>.lengths`` INT32 ``[B]`` (ids of each instance; 0 = none).
* the output ``probabilities``: FP32 ``[B]``, click probabilities in request order.

A ranking request (B candidates of one query) may send any input once for every candidate
by naming it ``context.<name>``: ``context.dense`` FP32 ``[1, N]``, ``context.<feature>``
INT64 ``[k]`` (that feature's one id list, no lengths). Every other input is per candidate
as above (B from ``dense``, or from the first candidate feature when dense is in the
context). An input given both ways, or neither, is refused naming it. It is forwarded as
our binary version 2 and scored exactly as the same instances.

Binary extension: the body is a JSON header of ``Inference-Header-Content-Length`` bytes,
then the raw little-endian, row-major bytes of each input whose ``parameters`` has
``binary_data_size``, in the order the header lists them. The response is binary when the
request asks (``outputs[i].parameters.binary_data`` or ``parameters.binary_data_output``).

Every violation raises a :mod:`serve.errors` exception naming the input and the rule; the
sidecar maps it once to OIP's ``{"error": "..."}``. Not for gRPC (not implemented).

Example::

    body, header_length = encode_infer_request(
        oip_inputs(dense, lengths, values), binary=True)        # a client's request
    req = parse_infer(body, header_length=header_length)      # what the sidecar does
    predict_body = to_predict_body(req)                       # -> TorchServe
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from serve.api.binary import encode_binary, encode_binary_ranking
from serve.api.config import HandlerConfig
from serve.api.context_body import assemble_context
from serve.api.request import INT64_MAX, ParsedRequest
from serve.api.spec import Spec, cap_rule, part_spec, spec_of
from serve.errors import InvalidInput, PayloadTooLarge
from serve.schema import ModelSchema

__all__ = [
    "CONTEXT_PREFIX",
    "DENSE_INPUT",
    "HEADER_LENGTH",
    "LENGTHS_SUFFIX",
    "OUTPUT_NAME",
    "InferRequest",
    "dimension_cap",
    "encode_infer_request",
    "encode_infer_response",
    "model_metadata",
    "oip_inputs",
    "parse_header_length",
    "parse_infer",
    "to_predict_body",
]

#: The dense input's name.
DENSE_INPUT = "dense"
#: ``context.`` + an input's name: that input sent once for every candidate of a ranking
#: request (``context.dense`` FP32 [1, N]; ``context.<feature>`` INT64 [k], one id list).
CONTEXT_PREFIX = "context."
#: ``<feature>`` + this names the lengths input of a multi-hot feature.
LENGTHS_SUFFIX = ".lengths"
#: The only output.
OUTPUT_NAME = "probabilities"
#: The binary extension's header: the JSON part's length in bytes.
HEADER_LENGTH = "Inference-Header-Content-Length"
_NP: dict[str, np.dtype[Any]] = {"FP32": np.dtype("<f4"), "INT64": np.dtype("<i8"),
                                 "INT32": np.dtype("<i4")}
_FP32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class InferRequest:
    """One parsed infer request.

    Attributes:
        parsed: dense float32 (B, N), lengths int32 (F, B), values int64 (nnz,)
            feature-major, as every form of our API gives.
        id: the request's ``id`` (echoed in the response), or None.
        binary_output: whether ``probabilities`` goes back as binary data.
    """

    parsed: ParsedRequest
    id: str | None
    binary_output: bool


def _inputs_text(spec: Spec) -> str:
    return (f"{DENSE_INPUT} FP32 [B, {spec.nd}], INT64 {spec.names_text} ([B] one id per "
            f"instance, or [nnz] with <feature>{LENGTHS_SUFFIX} INT32 [B] for multi-hot)")


def model_metadata(schema: ModelSchema | None, *, name: str, versions: list[str],
                   platform: str = "pytorch_torchrec") -> dict[str, Any]:
    """``GET /v2/models/{name}``: the served version's inputs and the output.

    Lists ``dense`` FP32 ``[-1, N]`` and each sparse feature INT64 ``[-1]`` (``-1``: any
    count; a feature whose schema allows several ids also takes ``<feature>.lengths``
    INT32 ``[-1]``, listed after it), then ``probabilities`` FP32 ``[-1]``.
    ``schema`` None: the built-in DLRM.
    """
    spec = spec_of(schema)
    inputs: list[dict[str, Any]] = [{"name": DENSE_INPUT, "datatype": "FP32",
                                     "shape": [-1, spec.nd]}]
    for fname, max_ids in zip(spec.names, spec.max_ids, strict=True):
        inputs.append({"name": fname, "datatype": "INT64", "shape": [-1]})
        if max_ids > 1:
            inputs.append({"name": fname + LENGTHS_SUFFIX, "datatype": "INT32", "shape": [-1]})
    return {"name": name, "versions": versions, "platform": platform, "inputs": inputs,
            "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1]}]}


def parse_header_length(value: str | None, body_size: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header: the JSON part's bytes (None: no
    header, the whole body is JSON)."""
    if value is None:
        return None
    text = value.strip()
    n = int(text) if text.isascii() and text.isdigit() else -1
    if not 0 < n <= body_size:
        raise InvalidInput(f"header {HEADER_LENGTH}: is {value[:40]!r}; it must be the JSON "
                           f"header's length, 1..{body_size} bytes (the body's size)")
    return n


def dimension_cap(cfg: HandlerConfig, spec: Spec) -> int:
    """The largest dimension any input may declare: no tensor of a request within
    ``cfg``'s limits is longer (ids of one feature: ``max_instances x`` the most ids per
    instance; dense features: the model's N). A larger one is refused before an array is
    made (a zero-size shape ``[0, 2**62]`` otherwise asks numpy for an impossible array)."""
    return cfg.max_instances * max(cfg.max_ids_per_feature, spec.nd, *spec.max_ids, 1)


def _shape(t: Mapping[str, Any], name: str, ndim: int, cap: int) -> tuple[int, ...]:
    shape = t.get("shape")
    want = "[B, N]" if ndim == 2 else "[B] or [nnz]"
    if (not isinstance(shape, list) or len(shape) != ndim
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise InvalidInput(f"input {name}: shape is {shape!r:.80}; it must be a list of "
                           f"{ndim} non-negative integer{'s' if ndim > 1 else ''} ({want})")
    if max(shape) > cap:
        raise InvalidInput(f"input {name}: shape is {shape!r:.80}; each dimension must be "
                           f"at most {cap} (the request limits); send {want} of what the "
                           "request holds")
    return tuple(shape)


def _from_json(data: Any, name: str, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """``data`` (flat or nested row-major JSON numbers) -> a ``shape`` array of
    ``datatype``; InvalidInput naming ``name`` for a wrong count, type or range."""
    count = math.prod(shape)
    if not isinstance(data, list):
        raise InvalidInput(f"input {name}: data is {type(data).__name__}; it must be a JSON "
                           f"list of {count} numbers (row-major), or binary data")
    try:
        arr = np.asarray(data)
    except (ValueError, OverflowError):
        raise InvalidInput(f"input {name}: data is ragged or mixed; send {count} numbers "
                           "(flat or nested row-major)") from None
    if arr.size != count or (arr.ndim != 1 and arr.shape != shape):
        raise InvalidInput(f"input {name}: data has {arr.size} values in shape "
                           f"{list(arr.shape)}; shape {list(shape)} needs {count}")
    if count == 0:
        return np.zeros(shape, dtype=_NP[datatype].newbyteorder("="))
    kind = arr.dtype.kind
    if kind != "b" and _has_bool(data):  # numpy reads true as 1: JSON's true is no number
        kind = "b"
    if datatype == "FP32":
        if kind not in "iuf":
            raise InvalidInput(f"input {name}: data holds {_kind(kind)}; FP32 values must be "
                               "finite JSON numbers within float32 range")
        wide = arr.astype(np.float64).reshape(shape)
        bad = ~np.isfinite(wide) | (np.abs(wide) > _FP32_MAX)
        if bad.any():
            at = np.argwhere(bad)[0].tolist()
            raise InvalidInput(f"input {name}: data{at} is {float(wide[tuple(at)])!r}; FP32 values "
                               "must be finite JSON numbers within float32 range")
        return wide.astype(np.float32)
    top = INT64_MAX if datatype == "INT64" else _INT32_MAX
    if kind not in "iu":
        # numpy gave up on integers (a float, a bool, a string, or an int beyond 64 bits
        # turned the array float or object): name the first value at fault.
        for k, v in enumerate(np.asarray(data, dtype=object).reshape(-1).tolist()):
            if type(v) is not int:
                raise InvalidInput(f"input {name}: data[{k}] is {v!r:.40}; {datatype} values "
                                   "must be JSON integers (no decimal point or exponent)")
            if not -top - 1 <= v <= top:
                raise InvalidInput(f"input {name}: data[{k}] is {v}; {datatype} values must "
                                   f"be in [{-top - 1}, {top}]")
        raise InvalidInput(f"input {name}: data holds {_kind(kind)}; {datatype} values must be "
                           "JSON integers (no decimal point or exponent)")
    flat = arr.reshape(-1)
    if int(flat.max()) > top:
        k = int(np.argmax(flat > top))
        raise InvalidInput(f"input {name}: data[{k}] is {int(flat[k])}; {datatype} values must "
                           f"be in [{-top - 1}, {top}]")
    if datatype == "INT32" and int(flat.min()) < -top - 1:
        k = int(np.argmax(flat < -top - 1))
        raise InvalidInput(f"input {name}: data[{k}] is {int(flat[k])}; INT32 values must "
                           f"be in [{-top - 1}, {top}]")
    return flat.astype(_NP[datatype].newbyteorder("=")).reshape(shape)


def _has_bool(data: list[Any]) -> bool:
    """Whether a (nested) list holds a JSON true or false (~30 ns per value)."""
    if data and isinstance(data[0], list):
        return any(_has_bool(row) for row in data if isinstance(row, list))
    return any(type(v) is bool for v in data)


def _kind(kind: str) -> str:
    return {"b": "booleans", "U": "strings", "S": "strings", "O": "non-numbers or integers "
            "beyond 64 bits", "f": "non-integers"}.get(kind, f"values of kind {kind!r}")


def _from_binary(raw: memoryview, name: str, datatype: str,
                 shape: tuple[int, ...]) -> np.ndarray:
    arr = np.frombuffer(raw, dtype=_NP[datatype]).astype(_NP[datatype].newbyteorder("="))
    arr = arr.reshape(shape)
    if datatype == "FP32":
        bad = ~np.isfinite(arr)
        if bad.any():
            at = np.argwhere(bad)[0].tolist()
            raise InvalidInput(f"input {name}: data{at} is {float(arr[tuple(at)])!r}; FP32 "
                               "values must be finite")
    return arr


def _load_header(body: memoryview) -> dict[str, Any]:
    try:
        head = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(f"body: is not valid JSON ({e}); send a UTF-8 JSON object "
                           f"{{\"inputs\": [...]}} (with binary data: its first "
                           f"{HEADER_LENGTH} bytes)") from None
    if not isinstance(head, dict):
        raise InvalidInput(f"body: is a JSON {type(head).__name__}; it must be an object "
                           "{\"inputs\": [{\"name\", \"datatype\", \"shape\", \"data\"}, ...]}")
    return head


def _wants_binary(head: Mapping[str, Any]) -> bool:
    params = head.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidInput("parameters: must be an object")
    binary = bool(params and params.get("binary_data_output") is True)
    outputs = head.get("outputs")
    if outputs is None:
        return binary
    if not isinstance(outputs, list):
        raise InvalidInput(f"outputs: is {type(outputs).__name__}; it must be a list of "
                           f"{{\"name\": \"{OUTPUT_NAME}\"}}")
    for i, o in enumerate(outputs):
        name = o.get("name") if isinstance(o, dict) else None
        if name != OUTPUT_NAME:
            raise InvalidInput(f"outputs[{i}].name: is {name!r}; the model's only output is "
                               f"{OUTPUT_NAME!r}")
        p = o.get("parameters") or {}
        if isinstance(p, dict) and "binary_data" in p:
            binary = p["binary_data"] is True
    return binary


def parse_infer(body: bytes | bytearray | memoryview, schema: ModelSchema | None = None,
                cfg: HandlerConfig | None = None, *,
                header_length: int | None = None) -> InferRequest:
    """``POST /v2/models/{m}/infer``'s body -> :class:`InferRequest`.

    Args:
        body: the whole body.
        schema: the served version's schema (None: the built-in DLRM).
        cfg: the limits (most instances, most ids per feature); default HandlerConfig().
        header_length: the ``Inference-Header-Content-Length`` (:func:`parse_header_length`);
            None: the whole body is the JSON header.
    Raises:
        InvalidInput: bad JSON, a missing, unknown or repeated input, a wrong datatype or
            shape (a dimension over :func:`dimension_cap` too), binary sizes that do not add up, a negative id or length, too many ids.
        PayloadTooLarge: more than ``cfg.max_instances`` instances.
    """
    cfg = cfg or HandlerConfig()
    spec = spec_of(schema)
    buf = memoryview(body).cast("B")
    split = buf.nbytes if header_length is None else header_length
    head = _load_header(buf[:split])
    binary_output = _wants_binary(head)
    rid = head.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInput(f"id: is {type(rid).__name__}; it must be a string")
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidInput(f"inputs: is {inputs!r:.80}; it must be a non-empty list of "
                           f"tensors: {_inputs_text(spec)}")
    known = {DENSE_INPUT: ("FP32", 2), CONTEXT_PREFIX + DENSE_INPUT: ("FP32", 2)}
    for f in spec.names:
        known[f] = ("INT64", 1)
        known[f + LENGTHS_SUFFIX] = ("INT32", 1)
        known[CONTEXT_PREFIX + f] = ("INT64", 1)
    tensors: dict[str, np.ndarray] = {}
    cap = dimension_cap(cfg, spec)
    at = split
    for i, t in enumerate(inputs):
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(name, str):
            raise InvalidInput(f"inputs[{i}]: is not an object with a string name; each "
                               "input is {\"name\", \"datatype\", \"shape\", \"data\"}")
        if name not in known:
            raise InvalidInput(f"input {name[:130]!r}: is not an input of this model; its "
                               f"inputs are {_inputs_text(spec)}")
        if name in tensors:
            raise InvalidInput(f"input {name}: is given twice; send each input once")
        datatype, ndim = known[name]
        if t.get("datatype") != datatype:
            raise InvalidInput(f"input {name}: datatype is {t.get('datatype')!r:.40}; it must "
                               f"be {datatype!r}")
        shape = _shape(t, name, ndim, cap)
        params = t.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is None:
            if "data" not in t:
                raise InvalidInput(f"input {name}: has no data; send \"data\" or binary data "
                                   "with parameters.binary_data_size")
            tensors[name] = _from_json(t["data"], name, datatype, shape)
            continue
        if "data" in t:
            raise InvalidInput(f"input {name}: has both data and binary_data_size; send one")
        want = math.prod(shape) * _NP[datatype].itemsize
        if type(size) is not int or size != want:
            raise InvalidInput(f"input {name}: binary_data_size is {size!r:.40}; shape "
                               f"{list(shape)} of {datatype} needs {want} bytes")
        if at + size > buf.nbytes:
            raise InvalidInput(f"input {name}: binary_data_size {size} runs past the body's "
                               f"end ({buf.nbytes - at} bytes of binary data left); the "
                               f"body must be the {HEADER_LENGTH} bytes of JSON, then each "
                               "binary input's bytes in order")
        tensors[name] = _from_binary(buf[at:at + size], name, datatype, shape)
        at += size
    if at != buf.nbytes:
        raise InvalidInput(f"body: {buf.nbytes - at} bytes follow the JSON header and the "
                           f"binary inputs (their binary_data_size sum to {at - split}); "
                           "they must add up to the body's size")
    parsed = _assemble(tensors, spec, cfg)
    return InferRequest(parsed, rid, binary_output)


def _assemble(tensors: dict[str, np.ndarray], spec: Spec, cfg: HandlerConfig) -> ParsedRequest:
    if any(n.startswith(CONTEXT_PREFIX) for n in tensors):
        return _assemble_ranking(tensors, spec, cfg)
    missing = [n for n in (DENSE_INPUT, *spec.names) if n not in tensors]
    if missing:
        raise InvalidInput(f"missing inputs {', '.join(missing[:8])}"
                           f"{' ...' if len(missing) > 8 else ''}; the model needs "
                           f"{_inputs_text(spec)}")
    for n in tensors:
        if n.endswith(LENGTHS_SUFFIX) and n[:-len(LENGTHS_SUFFIX)] not in tensors:
            raise InvalidInput(f"input {n}: is given without input "
                               f"{n[:-len(LENGTHS_SUFFIX)]}; send both")
    dense = tensors[DENSE_INPUT]
    b, nd = dense.shape
    if nd != spec.nd:
        raise InvalidInput(f"input {DENSE_INPUT}: shape is [{b}, {nd}]; it must be "
                           f"[B, {spec.nd}] (the model's dense features)")
    if b == 0:
        raise InvalidInput(f"input {DENSE_INPUT}: B is 0; send 1 to {cfg.max_instances} "
                           "instances")
    if b > cfg.max_instances:
        raise PayloadTooLarge(f"input {DENSE_INPUT}: B={b} instances exceed the limit of "
                              f"{cfg.max_instances} per request; split them over several "
                              "requests")
    caps = spec.caps(cfg.max_ids_per_feature)
    lengths = np.empty((spec.nf, b), dtype=np.int32)
    values = []
    for f, name in enumerate(spec.names):
        ids = tensors[name]
        lens = tensors.get(name + LENGTHS_SUFFIX)
        if lens is None:
            if ids.shape[0] != b:
                raise InvalidInput(f"input {name}: shape is [{ids.shape[0]}]; it must be "
                                   f"[B] = [{b}] (one id per instance, B from input "
                                   f"{DENSE_INPUT}), or the ids of every instance with "
                                   f"{name}{LENGTHS_SUFFIX} INT32 [B] for multi-hot")
            lengths[f] = 1
        else:
            if lens.shape[0] != b:
                raise InvalidInput(f"input {name}{LENGTHS_SUFFIX}: shape is [{lens.shape[0]}]; "
                                   f"it must be [B] = [{b}] (B from input {DENSE_INPUT})")
            if b and int(lens.min()) < 0:
                s = int(np.argmax(lens < 0))
                raise InvalidInput(f"input {name}{LENGTHS_SUFFIX}: data[{s}] is "
                                   f"{int(lens[s])}; lengths must be integers >= 0")
            total = int(lens.sum(dtype=np.int64))
            if total != ids.shape[0]:
                raise InvalidInput(f"input {name}: has {ids.shape[0]} ids but "
                                   f"{name}{LENGTHS_SUFFIX} sum to {total}; they must be equal")
            lengths[f] = lens
        if int(lengths[f].max()) > int(caps.arr[f]):
            s = int(np.argmax(lengths[f] > caps.arr[f]))
            raise InvalidInput(f"input {name}{LENGTHS_SUFFIX}: data[{s}] is "
                               f"{int(lengths[f, s])}; {cap_rule(caps, f, spec)}")
        _check_ids(name, ids)
        values.append(ids)
    return ParsedRequest(np.ascontiguousarray(dense, dtype=np.float32), lengths,
                         np.concatenate(values).astype(np.int64, copy=False))


def _check_ids(name: str, ids: np.ndarray) -> None:
    """InvalidInput naming input ``name`` and the first negative id, if any."""
    if ids.size and int(ids.min()) < 0:
        k = int(np.argmax(ids < 0))
        raise InvalidInput(f"input {name}: data[{k}] is {int(ids[k])}; ids must be "
                           "integers >= 0")


def _assemble_ranking(tensors: dict[str, np.ndarray], spec: Spec,
                      cfg: HandlerConfig) -> ParsedRequest:
    """A ranking infer: ``context.<name>`` inputs sent once for every candidate, the rest
    per candidate (B from ``dense`` or the candidate features) -> the ParsedRequest of the
    JSON context form (``shared``: the context's features)."""
    ctx_dense = tensors.pop(CONTEXT_PREFIX + DENSE_INPUT, None)
    ctx = {f: tensors.pop(CONTEXT_PREFIX + f) for f in spec.names
           if CONTEXT_PREFIX + f in tensors}
    both = [n for n in (DENSE_INPUT, *ctx) if n in tensors and (n != DENSE_INPUT
                                                                 or ctx_dense is not None)]
    if both:
        raise InvalidInput(f"inputs {', '.join(both)}: are also given as "
                           f"{CONTEXT_PREFIX}<name>; send each input in one part (context: "
                           "shared by every candidate, or per candidate)")
    for n in ctx:
        if n + LENGTHS_SUFFIX in tensors:
            raise InvalidInput(f"input {n}{LENGTHS_SUFFIX}: {n} is in the context "
                               f"({CONTEXT_PREFIX}{n}, one id list); send no lengths for it")
    cand = [f for f in spec.names if f not in ctx]
    missing = [n for n in ([DENSE_INPUT] if ctx_dense is None else []) + cand
               if n not in tensors]
    if missing:
        raise InvalidInput(f"missing inputs {', '.join(missing[:8])}"
                           f"{' ...' if len(missing) > 8 else ''}: each input goes per "
                           f"candidate or once as {CONTEXT_PREFIX}<name>")
    if ctx_dense is not None and tuple(ctx_dense.shape) != (1, spec.nd):
        raise InvalidInput(f"input {CONTEXT_PREFIX}{DENSE_INPUT}: shape is "
                           f"{list(ctx_dense.shape)}; it must be [1, {spec.nd}]")
    if DENSE_INPUT in tensors:
        b = tensors[DENSE_INPUT].shape[0]
    elif cand:
        first = cand[0]
        b = (tensors[first + LENGTHS_SUFFIX] if first + LENGTHS_SUFFIX in tensors
             else tensors[first]).shape[0]
    else:
        raise InvalidInput("the context holds every input (dense and sparse), so all "
                           "candidates would be the same instance; send at least one input "
                           "per candidate")
    # the candidates alone, as an instance request of their own features, then the context
    part = part_spec(spec, tuple(cand), spec.nd)
    tensors.setdefault(DENSE_INPUT, np.zeros((b, spec.nd), dtype=np.float32))
    cands = _assemble(tensors, part, cfg) if cand else ParsedRequest(
        _dense_checked(tensors[DENSE_INPUT], spec, cfg), np.zeros((0, b), np.int32),
        np.zeros(0, np.int64))
    caps = spec.caps(cfg.max_ids_per_feature)
    for name, ids in ctx.items():
        f = spec.names.index(name)
        if ids.shape[0] > int(caps.arr[f]):
            raise InvalidInput(f"input {CONTEXT_PREFIX}{name}: has {ids.shape[0]} ids; "
                               f"{cap_rule(caps, f, spec)}")
        _check_ids(CONTEXT_PREFIX + name, ids)
    return assemble_context(spec, cands, ctx, None if ctx_dense is None
                            else _dense_checked(ctx_dense, spec, cfg))


def _dense_checked(dense: np.ndarray, spec: Spec, cfg: HandlerConfig) -> np.ndarray:
    """A dense input (R, N) as float32, its N and R checked as the instance form's."""
    r, nd = dense.shape
    if nd != spec.nd:
        raise InvalidInput(f"input {DENSE_INPUT}: shape is [{r}, {nd}]; it must be "
                           f"[B, {spec.nd}] (the model's dense features)")
    if r > cfg.max_instances:
        raise PayloadTooLarge(f"input {DENSE_INPUT}: B={r} instances exceed the limit of "
                              f"{cfg.max_instances} per request")
    return np.ascontiguousarray(dense, dtype=np.float32)


def to_predict_body(req: InferRequest, schema: ModelSchema | None = None) -> bytes:
    """Our binary columnar predict body (``application/x-dlrm-columnar``) of ``req``:
    version 2 (ranking) when it has a context."""
    p = req.parsed
    if p.shared:
        # a dense vector identical in every row came from the context (or equals it)
        same = bool((p.dense == p.dense[:1]).all())
        return encode_binary_ranking(p.dense[:1] if same else p.dense, p.lengths, p.values,
                                     p.shared, dense_shared=same, schema=schema)
    return encode_binary(p.dense, p.lengths, p.values, schema=schema)


def encode_infer_response(probabilities: np.ndarray, *, model_name: str,
                          model_version: str | None, request_id: str | None,
                          binary: bool) -> tuple[bytes, int | None]:
    """The infer response: its body and, for binary output, the JSON part's length (the
    ``Inference-Header-Content-Length`` to send; None: all JSON).

    ``probabilities``: (B,) floats, sent as FP32 (float64 values that came from float32
    are exact).
    """
    probs = np.asarray(probabilities, dtype=np.float32).reshape(-1)
    out: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": [probs.size]}
    head: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        head["model_version"] = model_version
    if request_id is not None:
        head["id"] = request_id
    head["outputs"] = [out]
    if not binary:
        out["data"] = probs.tolist()
        return orjson.dumps(head), None
    raw = probs.astype("<f4").tobytes()
    out["parameters"] = {"binary_data_size": len(raw)}
    js = orjson.dumps(head)
    return js + raw, len(js)


def oip_inputs(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray,
               schema: ModelSchema | None = None, *,
               multi_hot: bool | None = None) -> dict[str, np.ndarray]:
    """Our arrays (dense (B, N), lengths (F, B), values (nnz,) feature-major) as OIP input
    tensors by name. ``multi_hot`` None: a feature gets ``<feature>.lengths`` only when
    some instance has other than one id."""
    spec = spec_of(schema)
    d = np.asarray(dense, dtype=np.float32)
    ln = np.asarray(lengths)
    v = np.asarray(values, dtype=np.int64)
    out: dict[str, np.ndarray] = {DENSE_INPUT: d}
    ends = np.concatenate([[0], np.cumsum(ln.sum(axis=1))]).astype(np.int64)
    for f, name in enumerate(spec.names):
        out[name] = v[ends[f]:ends[f + 1]]
        if multi_hot or (multi_hot is None and not (ln[f] == 1).all()):
            out[name + LENGTHS_SUFFIX] = ln[f].astype(np.int32)
    return out


def encode_infer_request(inputs: Mapping[str, np.ndarray], *, binary: bool = False,
                         binary_output: bool = False,
                         request_id: str | None = None) -> tuple[bytes, int | None]:
    """An infer body of ``inputs`` (name -> array; float32 -> FP32, int64 -> INT64, int32
    -> INT32): its bytes, and with ``binary`` the ``Inference-Header-Content-Length``."""
    names = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64",
             np.dtype(np.int32): "INT32"}
    head: dict[str, Any] = {}
    if request_id is not None:
        head["id"] = request_id
    tensors, blobs = [], []
    for name, a in inputs.items():
        arr = np.asarray(a)
        t: dict[str, Any] = {"name": name, "datatype": names[arr.dtype], "shape": list(arr.shape)}
        if binary:
            raw = arr.astype(_NP[t["datatype"]]).tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            t["data"] = arr.reshape(-1).tolist()
        tensors.append(t)
    head["inputs"] = tensors
    head["outputs"] = [{"name": OUTPUT_NAME, "parameters": {"binary_data": binary_output}}]
    js = orjson.dumps(head)
    return (js + b"".join(blobs), len(js)) if binary else (js, None)
