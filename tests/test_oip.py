"""Open Inference Protocol v2 (serve.api.oip): parsing JSON and binary tensors into the
same ParsedRequest our API gives, the response, the metadata of a schema, and every error
naming the input and the rule (messages pinned)."""
from __future__ import annotations

import asyncio
import dataclasses
import re

import httpx
import numpy as np
import orjson
import pytest

from serve.api.binary import example_binary
from serve.api.config import HandlerConfig
from serve.api.decode import parse_body
from serve.api.oip import (
    HEADER_LENGTH,
    encode_infer_request,
    encode_infer_response,
    model_metadata,
    oip_inputs,
    parse_header_length,
    parse_infer,
    to_predict_body,
)
from serve.api.request import BINARY_MEDIA_TYPE, INT64_MAX
from serve.errors import InvalidInput, PayloadTooLarge
from serve.schema import FeatureSpec, ModelSchema, TableSpec
from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.app import create_app
from serve.sidecar.http.oip_options import OipOptions
from serve.sidecar.http.oip_server import create_oip_app

CFG = HandlerConfig()
# An imported model's schema (as tests/test_protocol.py's): its own names, N = 3, one
# multi-hot feature capped at 20 ids by the model.
CUSTOM = ModelSchema(
    dense=3,
    tables=(TableSpec("t_user", rows=1000, dim=8), TableSpec("t_item", rows=5000, dim=8)),
    features=(FeatureSpec("user_id", "t_user", 1), FeatureSpec("item_id", "t_item", 1),
              FeatureSpec("history", "t_item", 20)))
CUSTOM_DENSE = np.array([[1.5, 2, -3.25], [0, 0.25, 1e3]], dtype=np.float32)
CUSTOM_LENGTHS = np.array([[1, 1], [1, 1], [3, 0]], dtype=np.int32)
CUSTOM_VALUES = np.array([7, INT64_MAX, 42, 43, 1, 2, 3], dtype=np.int64)


def _reference(n: int = 5, multi_hot: bool = False):
    return parse_body(example_binary(n, seed=3, multi_hot=multi_hot), CFG, BINARY_MEDIA_TYPE)


def _same(a, b) -> None:
    assert a.dense.dtype == np.float32 and a.lengths.dtype == np.int32
    assert a.values.dtype == np.int64
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.values, b.values)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
def test_json_and_binary_tensors_parse_to_our_api_s_request(binary, multi_hot):
    ref = _reference(multi_hot=multi_hot)
    body, header = encode_infer_request(oip_inputs(ref.dense, ref.lengths, ref.values),
                                        binary=binary, request_id="r-1")
    assert (header is not None) == binary
    req = parse_infer(body, header_length=header)
    _same(req.parsed, ref)
    assert req.id == "r-1" and req.binary_output is False
    # what goes to TorchServe is our binary form, parsed to the very same request
    _same(parse_body(to_predict_body(req), CFG, BINARY_MEDIA_TYPE), ref)


def test_one_hot_features_need_no_lengths_and_multi_hot_names_them():
    ref = _reference(multi_hot=True)
    inputs = oip_inputs(ref.dense, ref.lengths, ref.values)
    one_hot = [f"C{i}" for i in range(1, 27) if (ref.lengths[i - 1] == 1).all()]
    assert all(f"{f}.lengths" not in inputs for f in one_hot)
    assert any(k.endswith(".lengths") for k in inputs)


def test_nested_json_data_and_flat_data_are_the_same():
    ref = _reference(2)
    body, _ = encode_infer_request(oip_inputs(ref.dense, ref.lengths, ref.values))
    head = orjson.loads(body)
    head["inputs"][0]["data"] = ref.dense.astype(np.float64).tolist()  # [[...], [...]]
    _same(parse_infer(orjson.dumps(head)).parsed, ref)


def test_an_imported_schema_parses_with_its_own_names():
    inputs = oip_inputs(CUSTOM_DENSE, CUSTOM_LENGTHS, CUSTOM_VALUES, CUSTOM)
    assert sorted(inputs) == ["dense", "history", "history.lengths", "item_id", "user_id"]
    for binary in (False, True):
        body, header = encode_infer_request(inputs, binary=binary)
        p = parse_infer(body, CUSTOM, header_length=header).parsed
        np.testing.assert_array_equal(p.dense, CUSTOM_DENSE)
        np.testing.assert_array_equal(p.lengths, CUSTOM_LENGTHS)
        np.testing.assert_array_equal(p.values, CUSTOM_VALUES)


def test_metadata_of_an_imported_schema_lists_its_own_inputs_and_shapes():
    meta = model_metadata(CUSTOM, name="dlrm", versions=["own-ranker-int8"])
    assert meta == {
        "name": "dlrm", "versions": ["own-ranker-int8"], "platform": "pytorch_torchrec",
        "inputs": [{"name": "dense", "datatype": "FP32", "shape": [-1, 3]},
                   {"name": "user_id", "datatype": "INT64", "shape": [-1]},
                   {"name": "item_id", "datatype": "INT64", "shape": [-1]},
                   {"name": "history", "datatype": "INT64", "shape": [-1]},
                   {"name": "history.lengths", "datatype": "INT32", "shape": [-1]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1]}]}


def test_metadata_of_the_built_in_model():
    meta = model_metadata(None, name="dlrm", versions=["small-int8-s0"])
    names = [i["name"] for i in meta["inputs"]]
    assert names[:3] == ["dense", "C1", "C1.lengths"] and len(names) == 1 + 2 * 26
    assert meta["inputs"][0]["shape"] == [-1, 13]


@pytest.mark.parametrize("request_binary", [False, True])
def test_the_response_is_fp32_json_or_binary(request_binary):
    probs = np.array([0.5, 0.123456789], dtype=np.float32)
    body, header = encode_infer_response(probs.astype(np.float64), model_name="dlrm",
                                         model_version="v1", request_id="x",
                                         binary=request_binary)
    if not request_binary:
        assert header is None
        out = orjson.loads(body)
        assert out["model_name"] == "dlrm" and out["model_version"] == "v1" and out["id"] == "x"
        assert out["outputs"][0]["shape"] == [2] and out["outputs"][0]["datatype"] == "FP32"
        assert np.array_equal(np.asarray(out["outputs"][0]["data"], np.float32), probs)
    else:
        head = orjson.loads(body[:header])
        assert head["outputs"][0]["parameters"] == {"binary_data_size": 8}
        assert np.array_equal(np.frombuffer(body[header:], "<f4"), probs)


def test_binary_output_is_asked_per_output_or_for_the_request():
    ref = _reference(1)
    inputs = oip_inputs(ref.dense, ref.lengths, ref.values)
    body, _ = encode_infer_request(inputs, binary_output=True)
    assert parse_infer(body).binary_output is True
    head = orjson.loads(body)
    del head["outputs"]
    head["parameters"] = {"binary_data_output": True}  # what tritonclient sends without outputs
    assert parse_infer(orjson.dumps(head)).binary_output is True


# --------------------------------------------------------------------------- errors


def _json(mutate, n: int = 2, schema: ModelSchema | None = None) -> bytes:
    """A valid JSON body of n instances (one-hot, C3 multi-hot), changed by ``mutate(head)``."""
    if schema is None:
        ref = _reference(n)
        inputs = oip_inputs(ref.dense, ref.lengths, ref.values, multi_hot=False)
        inputs["C3.lengths"] = np.ones(n, np.int32)
    else:
        inputs = oip_inputs(CUSTOM_DENSE, CUSTOM_LENGTHS, CUSTOM_VALUES, schema)
    head = orjson.loads(encode_infer_request(inputs)[0])
    mutate(head)
    return orjson.dumps(head)


def _input(head, name):
    return next(t for t in head["inputs"] if t["name"] == name)


def _set(name, **fields):
    def mutate(head):
        _input(head, name).update(fields)
    return mutate


def _drop(name):
    def mutate(head):
        head["inputs"] = [t for t in head["inputs"] if t["name"] != name]
    return mutate


JSON_ERRORS = [
    ("bad JSON", b'{"inputs": [', r"^body: is not valid JSON \("),
    ("not an object", b"[1, 2]", r"^body: is a JSON list; it must be an object"),
    ("no inputs", b"{}", (r"^inputs: is None; it must be a non-empty list of tensors: dense FP32 "
                         r"\[B, 13\], INT64 C1\.\.C26 \(\[B\] one id per instance, or \[nnz\] "
                         r"with <feature>\.lengths INT32 \[B\] for multi-hot\)$")),
    ("wrong datatype", _json(_set("C5", datatype="INT32")),
     r"^input C5: datatype is 'INT32'; it must be 'INT64'$"),
    ("dense FP64", _json(_set("dense", datatype="FP64")),
     r"^input dense: datatype is 'FP64'; it must be 'FP32'$"),
    ("wrong rank", _json(_set("dense", shape=[26])),
     r"^input dense: shape is \[26\]; it must be a list of 2 non-negative integers \(\[B, N\]\)$"),
    ("wrong N", _json(_set("dense", shape=[2, 12], data=[0.5] * 24)),
     r"^input dense: shape is \[2, 12\]; it must be \[B, 13\] \(the model's dense features\)$"),
    ("data count", _json(_set("C7", data=[1, 2, 3])),
     r"^input C7: data has 3 values in shape \[3\]; shape \[2\] needs 2$"),
    ("shape vs B", _json(_set("C7", shape=[3], data=[1, 2, 3])),
     (r"^input C7: shape is \[3\]; it must be \[B\] = \[2\] \(one id per instance, B from input "
     r"dense\), or the ids of every instance with C7\.lengths INT32 \[B\] for multi-hot$")),
    ("missing input", _json(_drop("C7")),
     r"^missing inputs C7; the model needs dense FP32 \[B, 13\], INT64 C1\.\.C26"),
    ("unknown input", _json(lambda h: h["inputs"].append(
        {"name": "C27", "datatype": "INT64", "shape": [2], "data": [1, 2]})),
     r"^input 'C27': is not an input of this model; its inputs are dense FP32 \[B, 13\]"),
    ("repeated input", _json(lambda h: h["inputs"].append(dict(_input(h, "C2")))),
     r"^input C2: is given twice; send each input once$"),
    ("lengths without values", _json(lambda h: (_drop("C9")(h), h["inputs"].append(
        {"name": "C9.lengths", "datatype": "INT32", "shape": [2], "data": [1, 1]}))),
     r"^missing inputs C9;"),
    ("lengths sum", _json(_set("C3.lengths", data=[2, 1])),
     r"^input C3: has 2 ids but C3\.lengths sum to 3; they must be equal$"),
    ("lengths shape", _json(_set("C3.lengths", shape=[1], data=[2])),
     r"^input C3\.lengths: shape is \[1\]; it must be \[B\] = \[2\] \(B from input dense\)$"),
    ("negative length", _json(_set("C3.lengths", data=[-1, 3])),
     r"^input C3\.lengths: data\[0\] is -1; lengths must be integers >= 0$"),
    ("negative id", _json(_set("C4", data=[5, -5])),
     r"^input C4: data\[1\] is -5; ids must be integers >= 0$"),
    ("float id", _json(_set("C4", data=[5, 1.5])),
     (r"^input C4: data\[1\] is 1\.5; INT64 values must be JSON integers \(no decimal "
     r"point or exponent\)$")),
    ("bool id", _json(_set("C4", data=[True, 1])),
     r"^input C4: data\[0\] is True; INT64 values must be JSON integers"),
    ("length over int32", _json(_set("C3.lengths", data=[2**31, 1])),
     (r"^input C3\.lengths: data\[0\] is 2147483648; INT32 values must be in "
     r"\[-2147483648, 2147483647\]$")),
    ("id over int64", _json(_set("C4", data=[5, 2**63])),
     (r"^input C4: data\[1\] is 9223372036854775808; INT64 values must be in "
     r"\[-9223372036854775808, 9223372036854775807\]$")),
    ("string dense", _json(_set("dense", data=["a"] * 26)),
     (r"^input dense: data holds strings; FP32 values must be finite JSON numbers within "
     r"float32 range$")),
    ("dense out of float32", _json(_set("dense", data=[1e39] + [0.0] * 25)),
     (r"^input dense: data\[0, 0\] is 1e\+39; FP32 values must be finite JSON numbers within "
     r"float32 range$")),
    ("unknown output", _json(lambda h: h.update(outputs=[{"name": "scores"}])),
     r"^outputs\[0\]\.name: is 'scores'; the model's only output is 'probabilities'$"),
    ("B = 0", _json(lambda h: [t.update(shape=[0] + t["shape"][1:], data=[])
                               for t in h["inputs"]]),
     r"^input dense: B is 0; send 1 to 4096 instances$"),
]


@pytest.mark.parametrize("name,body,message", JSON_ERRORS, ids=[e[0] for e in JSON_ERRORS])
def test_bad_json_requests_name_the_input_and_the_rule(name, body, message):
    with pytest.raises(InvalidInput, match=message):
        parse_infer(body)


def test_too_many_ids_for_a_model_s_cap_names_the_feature():
    def mutate(h):
        _input(h, "history").update(shape=[21], data=list(range(21)))
        _input(h, "history.lengths").update(data=[21, 0])
    with pytest.raises(InvalidInput, match=re.escape(
            "input history.lengths: data[0] is 21; the model accepts at most 20 ids in "
            "history (its max_ids); drop or hash the extra ids")):
        parse_infer(_json(mutate, schema=CUSTOM), CUSTOM)


def test_a_criteo_body_for_an_imported_model_names_the_inputs():
    with pytest.raises(InvalidInput, match=r"^input 'C1': is not an input of this model; its "
                                           r"inputs are dense FP32 \[B, 3\], INT64 user_id, "
                                           r"item_id, history"):
        parse_infer(_json(lambda h: None), CUSTOM)


def test_too_many_instances_is_413():
    n = CFG.max_instances + 1
    inputs = {"dense": np.zeros((n, 13), np.float32),
              **{f"C{i}": np.zeros(n, np.int64) for i in range(1, 27)}}
    body, header = encode_infer_request(inputs, binary=True)
    with pytest.raises(PayloadTooLarge, match=r"^input dense: B=4097 instances exceed the "
                                              r"limit of 4096 per request; split them"):
        parse_infer(body, header_length=header)


def _binary(n: int = 2):
    ref = _reference(n)
    return encode_infer_request(oip_inputs(ref.dense, ref.lengths, ref.values), binary=True)


def _rebuild(body: bytes, header: int, mutate, extra: bytes = b"") -> tuple[bytes, int]:
    head = orjson.loads(body[:header])
    mutate(head)
    js = orjson.dumps(head)
    return js + body[header:] + extra, len(js)


def test_binary_size_not_matching_the_shape_names_the_input():
    body, header = _binary()
    bad, h = _rebuild(body, header, lambda hd: _input(hd, "C2")["parameters"].update(
        binary_data_size=8))
    with pytest.raises(InvalidInput, match=re.escape(
            "input C2: binary_data_size is 8; shape [2] of INT64 needs 16 bytes")):
        parse_infer(bad, header_length=h)


def test_binary_data_running_past_the_body_names_the_input():
    body, header = _binary()
    with pytest.raises(InvalidInput, match=r"^input C26: binary_data_size 16 runs past the "
                                           r"body's end \(8 bytes of binary data left\)"):
        parse_infer(body[:-8], header_length=header)


def test_binary_bytes_left_over_are_refused():
    body, header = _binary()
    with pytest.raises(InvalidInput, match=r"^body: 4 bytes follow the JSON header and the "
                                           r"binary inputs \(their binary_data_size sum to "
                                           r"520\); they must add up to the body's size$"):
        parse_infer(body + b"\0" * 4, header_length=header)


def test_binary_nan_dense_names_the_input():
    ref = _reference(2)
    dense = ref.dense.copy()
    dense[1, 4] = np.nan
    body, header = encode_infer_request(oip_inputs(dense, ref.lengths, ref.values), binary=True)
    with pytest.raises(InvalidInput, match=r"^input dense: data\[1, 4\] is nan; FP32 values "
                                           r"must be finite$"):
        parse_infer(body, header_length=header)


def test_binary_without_the_header_length_is_refused_naming_the_input():
    body, header = _binary()
    with pytest.raises(InvalidInput, match=r"^body: is not valid JSON"):
        parse_infer(body)  # no header: the binary tail is read as JSON
    head_only = body[:header]
    with pytest.raises(InvalidInput, match=r"^input dense: binary_data_size 104 runs past"):
        parse_infer(head_only)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "99999"])
def test_a_bad_header_length_is_refused(value):
    with pytest.raises(InvalidInput, match=r"^header Inference-Header-Content-Length: is "
                                           r".*; it must be the JSON header's length, "
                                           r"1\.\.100 bytes"):
        parse_header_length(value, 100)
    assert parse_header_length(None, 100) is None and parse_header_length(" 7 ", 100) == 7


def test_the_predict_body_keeps_an_imported_schema_s_shape():
    inputs = oip_inputs(CUSTOM_DENSE, CUSTOM_LENGTHS, CUSTOM_VALUES, CUSTOM)
    req = parse_infer(encode_infer_request(inputs)[0], CUSTOM)
    p = parse_body(to_predict_body(req, CUSTOM), CFG, BINARY_MEDIA_TYPE, schema=CUSTOM)
    np.testing.assert_array_equal(p.values, CUSTOM_VALUES)


# --------------------------------------------------------------------------- the OIP's app
# In process (ASGI), TorchServe and the sidecar's /readyz faked by an httpx.MockTransport:
# what reaches TorchServe, and how its answers map. tests/test_oip_http.py runs the real
# OIP process, sidecar and TorchServe.


class _FakeUpstreams:
    """TorchServe's inference answers and the sidecar's ``GET /readyz`` the OIP reads."""

    def __init__(self, status: int = 200, body: bytes = b"", ready: bool = True) -> None:
        self.status, self.body, self.ready = status, body, ready
        self.seen: list[httpx.Request] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        path = request.url.path
        if path == "/readyz":
            if not self.ready:
                return httpx.Response(503, json={
                    "code": 503, "type": "UpstreamUnavailable",
                    "message": "TorchServe management API at http://127.0.0.1:8081/models/dlrm "
                               "did not answer (ConnectError: refused)"})
            return httpx.Response(200, json={"status": "ready", "model": "dlrm",
                                             "model_version": "small-int8-s0",
                                             "ready_workers": 1})
        if path == "/predictions/dlrm":
            p = parse_body(request.content, CFG, request.headers["content-type"])
            body = self.body or orjson.dumps({"predictions": [0.25] * p.dense.shape[0]})
            return httpx.Response(self.status, content=body, headers={
                "X-DLRM-Model-Version": "small-int8-s0", "X-DLRM-Batch-Instances": "3"})
        return httpx.Response(404, json={"message": "no such path"})


OIP_OPTIONS = OipOptions(inference_url="http://ts:8080", sidecar_url="http://sidecar:8090",
                         parse_in="thread")


def _oip_calls(fake: _FakeUpstreams, *requests: tuple[str, str, dict],
               options: OipOptions = OIP_OPTIONS) -> list[httpx.Response]:
    transport = httpx.MockTransport(fake.handle)
    oip = create_oip_app(options, predict_client=httpx.AsyncClient(transport=transport),
                         sidecar_client=httpx.AsyncClient(transport=transport))

    async def go() -> list[httpx.Response]:
        async with oip.router.lifespan_context(oip), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=oip), base_url="http://oip") as c:
            return [await c.request(method, url, **kw) for method, url, kw in requests]
    return asyncio.run(go())


TOKEN = "t0ken-for-tests-t0ken-for-tests-0123"


def _body(n: int = 3) -> tuple[bytes, dict[str, str]]:
    ref = _reference(n)
    body, header = encode_infer_request(oip_inputs(ref.dense, ref.lengths, ref.values),
                                        binary=True, binary_output=True)
    return body, {HEADER_LENGTH: str(header)}


def test_infer_is_forwarded_as_our_binary_form_with_the_route_key():
    fake = _FakeUpstreams()
    body, headers = _body()
    (r,) = _oip_calls(fake, ("POST", "/v2/models/dlrm/infer", {
        "content": body, "headers": {**headers, "X-DLRM-Route-Key": "user-1"}}),
        options=dataclasses.replace(OIP_OPTIONS, parse_in="process"))  # as in production
    assert r.status_code == 200, r.text
    sent = fake.seen[-1]
    assert str(sent.url) == "http://ts:8080/predictions/dlrm"
    assert sent.headers["content-type"] == BINARY_MEDIA_TYPE
    assert sent.headers["x-dlrm-route-key"] == "user-1"
    _same(parse_body(sent.content, CFG, BINARY_MEDIA_TYPE), _reference(3))
    assert r.headers["x-dlrm-model-version"] == "small-int8-s0"
    header = int(r.headers[HEADER_LENGTH])
    assert orjson.loads(r.content[:header])["model_version"] == "small-int8-s0"
    assert np.array_equal(np.frombuffer(r.content[header:], "<f4"), np.full(3, 0.25, np.float32))


@pytest.mark.parametrize("status,body,want", [
    (400, b'{"code": 400, "type": "InvalidInput", "message": "binary body: too odd"}', 400),
    (413, b"", 413),
    (503, b'{"code": 503, "message": "has no worker to serve inference request"}', 503),
    (500, b"<html>boom</html>", 503),
])
def test_torchserve_s_answers_keep_their_meaning_in_oip_s_shape(status, body, want):
    fake = _FakeUpstreams(status=status, body=body)
    data, headers = _body()
    (r,) = _oip_calls(fake, ("POST", "/v2/models/dlrm/infer", {"content": data,
                                                                "headers": headers}))
    assert r.status_code == want and list(r.json()) == ["error"]
    assert r.json()["error"]


def test_not_ready_unknown_paths_and_compressed_bodies_answer_oip_errors():
    fake = _FakeUpstreams(ready=False)
    ready, model_ready, unknown, gz = _oip_calls(
        fake, ("GET", "/v2/health/ready", {}), ("GET", "/v2/models/dlrm/ready", {}),
        ("GET", "/v2/models/dlrm/versions/1", {}),
        ("POST", "/v2/models/dlrm/infer", {"content": b"{}",
                                           "headers": {"Content-Encoding": "gzip"}}))
    assert ready.status_code == 503 and ready.json()["error"].startswith(
        "TorchServe management API at")
    assert model_ready.status_code == 503
    assert unknown.status_code == 404 and "the Open Inference Protocol paths here are" in \
        unknown.json()["error"]
    assert gz.status_code == 415 and gz.json() == {
        "error": "header Content-Encoding: 'gzip' is not supported; send the body uncompressed"}


def test_state_names_the_oip_port_the_sidecar_does_not_serve():
    """GET /state names the OIP's URL; the sidecar's own app has no /v2 route (the
    protocol runs in a process of its own)."""
    app = create_app(SidecarConfig(token=TOKEN), oip_port=18192,
                     http_client=httpx.AsyncClient(transport=httpx.MockTransport(
                         _FakeUpstreams(ready=False).handle)))

    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://sidecar") as c:
            return [await c.get("/state"), await c.get("/v2/health/live")]
    state, v2 = asyncio.run(go())
    assert state.json()["endpoints"] == {"oip_url": "http://sidecar:18192"}
    assert v2.status_code == 404
