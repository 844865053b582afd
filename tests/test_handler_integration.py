"""The real TorchServe (fixture ``torchserve``) serving handlers/dlrm_handler.py from a .mar."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import orjson
import pytest
import torch

from serve.api.binary import encode_binary, example_binary
from serve.api.json_body import example_request
from serve.api.request import BINARY_MEDIA_TYPE, INT64_MAX
from serve.profiles import SPARSE_FEATURES
from tests.fixtures.torchserve import HANDLER_MAX_BODY, TS_MAX_REQUEST

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}
BINARY = {"Content-Type": BINARY_MEDIA_TYPE}


@pytest.fixture(scope="module")
def runtime(torchserve):
    """The in-process runtime on the same artifact, configured like the handler."""
    from serve.runtime.engine import Runtime, RuntimeConfig

    return Runtime.from_artifact(torchserve.artifact,
                                 RuntimeConfig(device="cpu", cache_load_factor=1.0, num_threads=1))


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=30) as c:
        yield c


def _multi_hot(n: int, seed: int) -> dict:
    """Rows with 0..3 ids per feature, some ids near 2^63-1 (exactness), some empty."""
    rng = np.random.default_rng(seed)
    body = example_request(n, seed=seed)
    for b, inst in enumerate(body["instances"]):
        for f in SPARSE_FEATURES:
            inst["sparse"][f] = rng.integers(0, 10**9, size=int(rng.integers(0, 4))).tolist()
        inst["sparse"]["C3"] = [INT64_MAX - b, 45821459]
    return body


def _to_columnar(body: dict) -> dict:
    inst = body["instances"]
    return {"dense": [i["dense"] for i in inst],
            "sparse": {f: {"values": [x for i in inst for x in i["sparse"][f]],
                           "lengths": [len(i["sparse"][f]) for i in inst]} for f in SPARSE_FEATURES}}


def _reference(runtime, body: dict) -> np.ndarray:
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.runtime.engine import SparseBatch

    p = parse_body(orjson.dumps(body), HandlerConfig(max_instances=10_000, max_ids_per_feature=64))
    return runtime.predict(torch.from_numpy(p.dense), SparseBatch(
        torch.from_numpy(p.values), torch.from_numpy(p.lengths))).numpy()


@pytest.mark.parametrize("form", ["rows", "columnar"])
def test_predictions_equal_the_in_process_runtime(torchserve, runtime, client, form):
    body = _multi_hot(37, seed=3)
    want = _reference(runtime, body)
    send = body if form == "rows" else _to_columnar(body)
    r = client.post(torchserve.predict_url, content=orjson.dumps(send), headers=JSON)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    got = np.array(r.json()["predictions"], dtype=np.float32)
    assert got.shape == (37,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert ((got > 0) & (got < 1)).all()
    # A different id in the exact-int64 range changes the answer: ids are not rounded.
    # Instance 0 sends C3 = 2^63-1; 2^63-2 is the same float64, so a path through float
    # would answer the same; exactly parsed, it wraps to another row and another answer.
    other = orjson.loads(orjson.dumps(body))          # a deep copy; orjson keeps int64 exact
    assert other["instances"][0]["sparse"]["C3"][0] == INT64_MAX
    other["instances"][0]["sparse"]["C3"][0] = INT64_MAX - 1
    assert float(INT64_MAX - 1) == float(INT64_MAX)
    send = other if form == "rows" else _to_columnar(other)
    r = client.post(torchserve.predict_url, content=orjson.dumps(send), headers=JSON)
    assert r.status_code == 200, r.text
    got_other = np.array(r.json()["predictions"], dtype=np.float32)
    np.testing.assert_allclose(got_other, _reference(runtime, other), rtol=0, atol=1e-6)
    assert got_other[0] != got[0]
    assert 0 < got_other[0] < 1


def test_big_ids_are_not_rounded_through_float(torchserve, runtime, client):
    """45821459 and 45821460 are one float32 apart; both must reach the model as sent."""
    a, b = example_request(1, seed=9), example_request(1, seed=9)
    a["instances"][0]["sparse"]["C1"] = [45821459]
    b["instances"][0]["sparse"]["C1"] = [45821460]
    got = [client.post(torchserve.predict_url, content=orjson.dumps(x), headers=JSON)
           .json()["predictions"][0] for x in (a, b)]
    want = [float(_reference(runtime, x)[0]) for x in (a, b)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _concurrent(url: str, bodies: list[bytes], headers=JSON) -> list[httpx.Response]:
    """Send all bodies at once (a barrier releases the threads together)."""
    barrier = threading.Barrier(len(bodies))

    def one(body: bytes) -> httpx.Response:
        with httpx.Client(timeout=30) as c:
            barrier.wait()
            return c.post(url, content=body, headers=headers)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_concurrent_requests_are_merged_into_one_forward(torchserve, runtime):
    bodies = [example_request(3, seed=100 + i) for i in range(16)]
    seen = []
    for _attempt in range(5):  # merging depends on arrival; 50 ms delay makes it near-certain
        responses = _concurrent(torchserve.predict_url, [orjson.dumps(b) for b in bodies])
        for resp, body in zip(responses, bodies, strict=True):
            assert resp.status_code == 200, resp.text
            np.testing.assert_allclose(resp.json()["predictions"], _reference(runtime, body),
                                       rtol=0, atol=1e-6)
            seen.append((int(resp.headers["x-dlrm-batch-requests"]),
                         int(resp.headers["x-dlrm-batch-instances"])))
        if max(r for r, _ in seen) > 1:
            break
    requests, instances = max(seen)
    assert 1 < requests <= torchserve.batch_size
    assert instances == 3 * requests  # every instance of every merged request in one forward
    _assert_metrics_saw_merged_batches(torchserve)


def _assert_metrics_saw_merged_batches(torchserve) -> None:
    """The handler's multiprocess metrics record the same merged batches."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    from serve.metrics import BATCH_REQUESTS

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(torchserve.multiproc_dir))
    buckets = {s.labels["le"]: s.value for m in reg.collect() if m.name == BATCH_REQUESTS
               for s in m.samples if s.name.endswith("_bucket")}
    assert buckets, f"no {BATCH_REQUESTS} samples in {torchserve.multiproc_dir}"
    assert buckets["+Inf"] > buckets["1.0"], buckets  # some forward served > 1 request


def test_one_bad_request_does_not_fail_its_batch(torchserve, runtime):
    good = [example_request(2, seed=200 + i) for i in range(6)]
    bad = _multi_hot(2, seed=5)
    bad["instances"][1]["sparse"]["C7"] = [-5]
    bad_body = {"code": 400, "type": "InvalidInput",
                "message": "instances[1].sparse.C7[0]: -5 is negative; ids must be integers >= 0"}
    shared = False
    for _attempt in range(5):
        bodies = [orjson.dumps(b) for b in good[:3]] + [orjson.dumps(bad)] + \
                 [orjson.dumps(b) for b in good[3:]]
        responses = _concurrent(torchserve.predict_url, bodies)
        bad_resp = responses[3]
        assert bad_resp.status_code == 400
        assert bad_resp.json() == bad_body
        for resp, body in zip(responses[:3] + responses[4:], good, strict=True):
            assert resp.status_code == 200, resp.text
            np.testing.assert_allclose(resp.json()["predictions"], _reference(runtime, body),
                                       rtol=0, atol=1e-6)
        # the bad request rode in a TorchServe batch with good ones that were answered
        if int(bad_resp.headers["x-dlrm-torchserve-batch"]) > 1 and \
                int(bad_resp.headers["x-dlrm-batch-requests"]) >= 1:
            shared = True
            break
    assert shared, "the bad request never shared a TorchServe batch with good ones"


def _err(msg: str, code: int = 400, kind: str = "InvalidInput") -> dict:
    return {"code": code, "type": kind, "message": msg}


def _row_with(feature: str, ids) -> bytes:
    d = example_request(1, seed=1)
    d["instances"][0]["sparse"][feature] = ids
    return orjson.dumps(d)


def _row_dense(j: int, v) -> bytes:
    d = example_request(1, seed=1)
    d["instances"][0]["dense"][j] = v
    return orjson.dumps(d)


ID_RULE = "ids must be JSON integers in [0, 2^63-1]"
DENSE_RULE = "dense values must be finite JSON numbers within float32 range"
_one = example_request(1, seed=1)
_missing = orjson.loads(orjson.dumps(_one))
del _missing["instances"][0]["sparse"]["C7"]
_unknown = orjson.loads(orjson.dumps(_one))
_unknown["instances"][0]["sparse"]["X1"] = [1]
_short = orjson.loads(orjson.dumps(_one))
_short["instances"][0]["dense"] = [1.0] * 12

HTTP_BAD = [
    ("invalid json", b'{"instances": [', _err(
        "body is not valid JSON (unexpected end of data: line 1 column 16 (char 15)); send UTF-8 "
        "JSON (NaN and Infinity are not JSON numbers)")),
    ("NaN", b'{"instances": [{"dense": [NaN]}]}', _err(
        "body is not valid JSON (unexpected character, expected a JSON value: line 1 column 27 "
        "(char 26)); send UTF-8 JSON (NaN and Infinity are not JSON numbers)")),
    ("Infinity", b'{"instances": [{"dense": [1e999]}]}', _err(
        "body is not valid JSON (number is infinity when parsed as double: line 1 column 27 "
        "(char 26)); send UTF-8 JSON (NaN and Infinity are not JSON numbers)")),
    ("top-level array", b"[]", _err(
        'body is a JSON array; expected an object {"instances": [...]} (rows) or '
        '{"dense": [...], "sparse": {...}} (columnar)')),
    ("missing feature", orjson.dumps(_missing), _err(
        "instances[0].sparse: missing features C7; every instance needs exactly the sparse "
        "features C1..C26 (an empty list [] for no ids)")),
    ("unknown feature", orjson.dumps(_unknown), _err(
        "instances[0].sparse: unknown features X1; every instance needs exactly the sparse "
        "features C1..C26 (an empty list [] for no ids)")),
    ("dense wrong length", orjson.dumps(_short), _err(
        "instances[0].dense: has 12 values; it must have exactly 13 (the model's dense "
        "features)")),
    ("dense string", _row_dense(3, "x"), _err(
        f'instances[0].dense[3]: "x" is a string, not a number; {DENSE_RULE}')),
    ("dense null", _row_dense(0, None), _err(f"instances[0].dense[0]: null is not a number; {DENSE_RULE}")),
    ("fractional id", _row_with("C2", [1.5]), _err(
        f"instances[0].sparse.C2[0]: 1.5 is not an integer; {ID_RULE} (no decimal point or exponent)")),
    ("negative id", _row_with("C7", [-5]), _err(
        "instances[0].sparse.C7[0]: -5 is negative; ids must be integers >= 0")),
    ("id over 2^63-1", _row_with("C9", [2**63]), _err(
        f"instances[0].sparse.C9[0]: 9223372036854775808 is greater than 2^63-1 "
        f"(9223372036854775807); {ID_RULE}")),
    ("bool id", _row_with("C9", [False]), _err(
        f"instances[0].sparse.C9[0]: false is a boolean, not an integer; {ID_RULE}")),
    ("empty instances", b'{"instances": []}', _err("instances: is empty; send 1 to 1024 instances")),
    ("too many instances", orjson.dumps(example_request(1025)), _err(
        "instances: 1025 instances exceed the limit of 1024 per request; split them over several "
        "requests", 413, "PayloadTooLarge")),
    ("too many ids", _row_with("C4", list(range(9))), _err(
        "instances[0].sparse.C4: has 9 ids; at most 8 ids per feature are allowed; drop or hash "
        "the extra ids")),
    ("columnar lengths", orjson.dumps({"dense": [[1] * 13], "sparse": {
        f: {"values": [1], "lengths": [2 if f == "C5" else 1]} for f in SPARSE_FEATURES}}), _err(
        "sparse.C5: lengths sum to 2 but values has 1 ids; they must be equal")),
]


@pytest.mark.parametrize("name,body,want", HTTP_BAD, ids=[c[0] for c in HTTP_BAD])
def test_bad_input_gets_4xx_json(torchserve, client, name, body, want):
    r = client.post(torchserve.predict_url, content=body, headers=JSON)
    assert r.status_code == want["code"]
    assert r.headers["content-type"] == "application/json"
    assert r.json() == want


@pytest.mark.parametrize("ctype,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), (None, 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("application/json; charset=latin-1", 415)])
def test_content_types(torchserve, client, ctype, status):
    headers = {"Content-Type": ctype} if ctype else {}
    body = orjson.dumps(example_request(1))
    if ctype is None:  # httpx adds no Content-Type for raw content
        r = client.post(torchserve.predict_url, content=body)
    else:
        r = client.post(torchserve.predict_url, content=body, headers=headers)
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json() == _err(f"Content-Type '{ctype}' is not supported; send the body as JSON "
                                "with 'Content-Type: application/json' (charset utf-8), or binary "
                                "columnar with 'Content-Type: application/x-dlrm-columnar'",
                                415, "UnsupportedMediaType")


def _to_binary(body: dict) -> bytes:
    """A row-form body as the binary columnar form (same instances, same order)."""
    inst = body["instances"]
    dense = np.array([i["dense"] for i in inst], dtype=np.float32)
    lengths = np.array([[len(i["sparse"][f]) for i in inst] for f in SPARSE_FEATURES])
    values = np.array([x for f in SPARSE_FEATURES for i in inst for x in i["sparse"][f]],
                      dtype=np.int64)
    return encode_binary(dense, lengths, values)


def test_binary_predictions_equal_the_runtime_and_the_json_form(torchserve, runtime, client):
    """TorchServe hands the binary body over untouched (TS_DECODE_INPUT_REQUEST=false)."""
    body = _multi_hot(37, seed=3)
    r = client.post(torchserve.predict_url, content=_to_binary(body), headers=BINARY)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    got = np.array(r.json()["predictions"], dtype=np.float32)
    assert got.shape == (37,)
    np.testing.assert_allclose(got, _reference(runtime, body), rtol=0, atol=1e-6)
    as_json = client.post(torchserve.predict_url, content=orjson.dumps(body), headers=JSON)
    assert as_json.json()["predictions"] == r.json()["predictions"]


HTTP_BAD_BINARY = [
    ("negative id", _to_binary(_multi_hot(2, seed=5))[:-8] + np.int64(-5).tobytes(), _err(
        "binary body: values[80] (C26, sample 1): -5 is negative; ids must be integers >= 0")),
    ("truncated", example_binary(3, seed=1)[:-1], _err(
        "binary body: is 1111 bytes; the header (B=3, nnz=78) needs 1112 bytes; nnz is the sum "
        "of lengths and each id is 8 bytes")),
    ("wrong magic", b"XXXX" + example_binary(1)[4:], _err(
        "binary body: magic is b'XXXX'; expected b'DLRM' as the first 4 bytes (JSON bodies need "
        "'Content-Type: application/json')")),
    ("too many instances", example_binary(1025), _err(
        "binary body: B=1025 instances exceed the limit of 1024 per request; split them over "
        "several requests", 413, "PayloadTooLarge")),
]


@pytest.mark.parametrize("name,body,want", HTTP_BAD_BINARY, ids=[c[0] for c in HTTP_BAD_BINARY])
def test_bad_binary_gets_4xx_json_and_the_worker_lives(torchserve, client, name, body, want):
    pids = torchserve.worker_pids()
    r = client.post(torchserve.predict_url, content=body, headers=BINARY)
    assert r.status_code == want["code"]
    assert r.headers["content-type"] == "application/json"
    assert r.json() == want
    ok = client.post(torchserve.predict_url, content=example_binary(2, seed=8), headers=BINARY)
    assert ok.status_code == 200, ok.text
    assert torchserve.worker_pids() == pids


@pytest.mark.parametrize("ctype", ["application/octet-stream",
                                   "application/x-dlrm-columnar; charset=utf-8"])
def test_binary_body_with_another_content_type_gets_415(torchserve, client, ctype):
    r = client.post(torchserve.predict_url, content=example_binary(2), headers={"Content-Type": ctype})
    assert r.status_code == 415
    assert r.json() == _err(f"Content-Type '{ctype}' is not supported; send the body as JSON with "
                            "'Content-Type: application/json' (charset utf-8), or binary columnar "
                            "with 'Content-Type: application/x-dlrm-columnar'",
                            415, "UnsupportedMediaType")


def test_huge_bodies_get_413(torchserve, client):
    over_ours = b'{"instances": ' + b" " * HANDLER_MAX_BODY + b"[]}"
    r = client.post(torchserve.predict_url, content=over_ours, headers=JSON)
    assert r.status_code == 413
    assert r.json() == _err(f"body is {len(over_ours)} bytes; the limit is {HANDLER_MAX_BODY} "
                            "bytes; split the instances over several requests", 413, "PayloadTooLarge")
    # Over TorchServe's own max_request_size the frontend answers 413 itself, without
    # a body (documented in the README); the worker never sees it.
    over_ts = b" " * (TS_MAX_REQUEST + 1)
    r = client.post(torchserve.predict_url, content=over_ts, headers=JSON)
    assert r.status_code == 413
    ok = client.post(torchserve.predict_url, content=orjson.dumps(example_request(2)), headers=JSON)
    assert ok.status_code == 200


def test_killed_worker_is_restarted_and_serves_again(torchserve, client):
    """kill -9 of the worker: TorchServe starts a new one; predicts succeed within 30 s."""
    (old,) = torchserve.worker_pids()
    os.kill(old, signal.SIGKILL)
    body = orjson.dumps(example_request(4, seed=7))
    deadline = time.monotonic() + 30
    status, new = None, []
    while time.monotonic() < deadline:
        try:
            r = client.post(torchserve.predict_url, content=body, headers=JSON, timeout=10)
            status = r.status_code
        except httpx.HTTPError:
            status = None
        if status == 200:
            new = torchserve.worker_pids()
            if new and old not in new:
                break
        time.sleep(0.5)
    assert status == 200, f"no successful predict within 30 s after kill -9 (last {status})"
    assert new and old not in new, f"worker pid {old} still listed: {new}"


def _served_version(torchserve) -> str:
    """The repository version behind TorchServe's default version of the model."""
    from serve.state import parse_serving_version

    desc = httpx.get(f"{torchserve.management_url}/models/{torchserve.model_name}",
                     timeout=10).json()[0]
    parsed = parse_serving_version(str(desc["modelVersion"]))
    return parsed[0] if parsed else str(desc["modelVersion"])


def test_every_response_names_the_model_version_that_answered(torchserve, client):
    want = _served_version(torchserve)
    ok = client.post(torchserve.predict_url, content=orjson.dumps(example_request(2)),
                     headers=JSON)
    bad = client.post(torchserve.predict_url, content=b'{"instances": []}', headers=JSON)
    wrong_type = client.post(torchserve.predict_url, content=b"x",
                             headers={"Content-Type": "text/plain"})
    assert [r.status_code for r in (ok, bad, wrong_type)] == [200, 400, 415]
    for r in (ok, bad, wrong_type):
        assert r.headers["x-dlrm-model-version"] == want, r.headers
    # Every response of a merged TorchServe batch, the bad one included.
    bodies = [orjson.dumps(example_request(1, seed=i)) for i in range(5)] + [b"{}"]
    for r in _concurrent(torchserve.predict_url, bodies):
        assert r.headers["x-dlrm-model-version"] == want
