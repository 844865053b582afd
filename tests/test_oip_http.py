"""The Open Inference Protocol v2 through its real process (the sidecar's ``--oip-port``
starts it) and the real TorchServe (the session's fixtures): health, metadata, JSON and
binary infer equal to our own API's answers for the same instances, and bad requests
answered 400 ``{"error"}`` naming the input, never a 5xx."""
from __future__ import annotations

import socket

import httpx
import numpy as np
import orjson
import pytest
import torch

from serve.api.binary import encode_binary
from serve.api.oip import HEADER_LENGTH, encode_infer_request, oip_inputs
from serve.api.request import BINARY_MEDIA_TYPE, DEFAULT_SCHEMA
from tests.fixtures.sidecar import SESSION_VERSION

pytestmark = pytest.mark.integration

N = 64


def _instances(n: int = N, seed: int = 0, multi_hot: bool = True):
    """dense (n, 13) float32, lengths (26, n) int32 (with ``multi_hot`` every third
    feature 0..3 ids; else and the rest one), values (nnz,) int64 feature-major."""
    rng = np.random.default_rng(seed)
    dense = rng.random((n, DEFAULT_SCHEMA.dense), dtype=np.float32)
    lengths = np.ones((len(DEFAULT_SCHEMA.features), n), dtype=np.int32)
    if multi_hot:
        lengths[2::3] = rng.integers(0, 4, size=lengths[2::3].shape)
    values = rng.integers(0, 2**40, size=int(lengths.sum()), dtype=np.int64)
    return dense, lengths, values


def _ours(torchserve, dense, lengths, values) -> np.ndarray:
    r = httpx.post(torchserve.predict_url, content=encode_binary(dense, lengths, values),
                   headers={"Content-Type": BINARY_MEDIA_TYPE}, timeout=60)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["predictions"], dtype=np.float64).astype(np.float32)


def _infer(sidecar, body: bytes, header: int | None = None, **headers: str) -> httpx.Response:
    h = dict(headers)
    if header is not None:
        h[HEADER_LENGTH] = str(header)
    return httpx.post(f"{sidecar.oip_url}/v2/models/dlrm/infer", content=body, headers=h,
                      timeout=60)


def _probabilities(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    header = r.headers.get(HEADER_LENGTH)
    if header is None:
        out = r.json()["outputs"][0]
        assert out["name"] == "probabilities" and out["datatype"] == "FP32"
        return np.asarray(out["data"], dtype=np.float32)
    head = orjson.loads(r.content[:int(header)])
    out = head["outputs"][0]
    assert out["parameters"]["binary_data_size"] == len(r.content) - int(header)
    return np.frombuffer(r.content[int(header):], dtype="<f4")


def test_state_names_the_oip_base_url(sidecar):
    state = httpx.get(f"{sidecar.url}/state", timeout=30).json()
    assert state["endpoints"] == {"oip_url": sidecar.oip_url}


def test_health_ready_and_metadata(sidecar):
    base = f"{sidecar.oip_url}/v2"
    assert httpx.get(f"{base}/health/live").json() == {"live": True}
    assert httpx.get(f"{base}/health/ready", timeout=30).json() == {"ready": True}
    assert httpx.get(f"{base}/models/dlrm/ready", timeout=30).json() == {
        "name": "dlrm", "ready": True}
    meta = httpx.get(f"{base}/models/dlrm", timeout=30).json()
    assert meta["name"] == "dlrm" and meta["versions"] == [SESSION_VERSION]
    assert meta["inputs"][0] == {"name": "dense", "datatype": "FP32", "shape": [-1, 13]}
    names = [i["name"] for i in meta["inputs"] if not i["name"].endswith(".lengths")]
    assert names == ["dense", *(f"C{i}" for i in range(1, 27))]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1]}]
    r = httpx.get(f"{base}/models/other")
    assert r.status_code == 404 and r.json() == {
        "error": "model 'other' is not served here; this server serves 'dlrm' "
                 "(GET /v2/models/dlrm)"}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_equals_our_api(sidecar, torchserve, binary):
    dense, lengths, values = _instances()
    ours = _ours(torchserve, dense, lengths, values)
    body, header = encode_infer_request(oip_inputs(dense, lengths, values), binary=binary,
                                        binary_output=binary, request_id="req-7")
    r = _infer(sidecar, body, header)
    theirs = _probabilities(r)
    assert theirs.shape == (N,)
    assert np.array_equal(theirs, ours)
    assert torch.equal(torch.from_numpy(theirs.copy()), torch.from_numpy(ours))
    head = orjson.loads(r.content[:int(r.headers[HEADER_LENGTH])] if binary else r.content)
    assert head["id"] == "req-7" and head["model_name"] == "dlrm"
    # TorchServe's batch headers come back: the request went through its batching
    assert int(r.headers["X-DLRM-Batch-Instances"]) >= N


def _json_body(mutate) -> bytes:
    """A valid one-hot JSON body of 2 instances (C1 with its lengths), then ``mutate``d."""
    dense, lengths, values = _instances(2, multi_hot=False)
    inputs = oip_inputs(dense, lengths, values, multi_hot=False)
    inputs["C1.lengths"] = np.ones(2, np.int32)
    head = orjson.loads(encode_infer_request(inputs)[0])
    mutate(head)
    return orjson.dumps(head)


def _set(name, **fields):
    return lambda h: next(t for t in h["inputs"] if t["name"] == name).update(fields)


BAD = [
    ("bad JSON", b'{"inputs": [', None, "body: is not valid JSON"),
    ("wrong datatype", _json_body(_set("C5", datatype="FP32")), None,
     "input C5: datatype is 'FP32'; it must be 'INT64'"),
    ("wrong shape", _json_body(_set("C6", shape=[3], data=[1, 2, 3])), None,
     "input C6: shape is [3]; it must be [B] = [2]"),
    ("missing input", _json_body(lambda h: h.update(inputs=h["inputs"][:-2])), None,
     "missing inputs C26;"),
    ("unknown input", _json_body(lambda h: h["inputs"].append(
        {"name": "C99", "datatype": "INT64", "shape": [2], "data": [1, 2]})), None,
     "input 'C99': is not an input of this model"),
    ("negative id", _json_body(_set("C8", data=[1, -2])), None,
     "input C8: data[1] is -2; ids must be integers >= 0"),
    ("lengths sum", _json_body(_set("C1.lengths", data=[2, 1])), None,
     "input C1: has 2 ids but C1.lengths sum to 3"),
    ("header length", _json_body(lambda h: None), "abc",
     "header Inference-Header-Content-Length: is 'abc'"),
    # N6: a zero-size tensor with a huge dimension was a 500 with a logged traceback
    ("huge dimension", _json_body(_set("dense", shape=[0, 2**62], data=[])), None,
     f"input dense: shape is [0, {2**62}]; each dimension must be at most"),
]


def test_bad_requests_are_400_naming_the_input_never_5xx(sidecar):
    statuses = []
    for _, body, header, message in BAD:
        headers = {HEADER_LENGTH: header} if header is not None else {}
        r = httpx.post(f"{sidecar.oip_url}/v2/models/dlrm/infer", content=body,
                       headers=headers, timeout=30)
        statuses.append(r.status_code)
        assert r.status_code == 400, (r.status_code, r.text)
        assert list(r.json()) == ["error"] and r.json()["error"].startswith(message), r.json()
    # binary sizes that do not add up
    dense, lengths, values = _instances(2)
    body, header = encode_infer_request(oip_inputs(dense, lengths, values), binary=True)
    r = _infer(sidecar, body[:-8], header)
    statuses.append(r.status_code)
    assert r.status_code == 400 and r.json()["error"].startswith(
        "input C26: binary_data_size 16 runs past the body's end"), r.text
    assert not [s for s in statuses if s >= 500]


def test_a_body_over_the_limit_is_413_before_it_is_read(sidecar):
    """A 64 MiB Content-Length is refused on the headers: one byte of body is sent."""
    host, port = sidecar.oip_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v2/models/dlrm/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: 67108864\r\n\r\n{")
        # The answer may come in several segments (headers, then body); the server
        # closes the connection after it ("connection: close").
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        answer = b"".join(chunks).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert '{"error":"body: 67108864 bytes is over the 8388608-byte limit' in answer
