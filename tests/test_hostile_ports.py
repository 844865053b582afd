"""Hostile input to every port the pod opens (issue 54): malformed, oversized, wrongly
typed and deeply nested bodies to TorchServe's inference port (8080), the sidecar's read
port (8090), its write port (8091, with the token) and the Open Inference Protocol's
process (8092) each get a 4xx (a JSON body naming the problem from our own edges), never
a 5xx; afterwards every part still answers (nothing died)."""
from __future__ import annotations

import contextlib
import http.client
import json
from urllib.parse import urlsplit

import pytest

from serve.api.json_body import example_request

pytestmark = pytest.mark.integration

DEEP = b"[" * 200_000 + b"]" * 200_000
MALFORMED = b'{"instances": [{"dense": [0.1, '


def _send(url: str, method: str, body: bytes, headers: dict[str, str] | None = None
          ) -> tuple[int, bytes]:
    """(status, body) of one request over http.client, which still reads an answer the
    server sends before it has read the whole body (TorchServe's 413 on the headers)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        # the server may answer and close while we are still sending
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _cases(big: int) -> dict[str, bytes]:
    return {"malformed": MALFORMED, "nested": DEEP, "oversized": b"[" + b"0," * big + b"0]",
            "wrong type": json.dumps({"instances": "all of them", "inputs": 7,
                                      "model": {"version": ["x"]}, "rows": {"a": 1}}).encode(),
            # review N6: a zero-size tensor with a huge dimension (was a 500 on 8092)
            "huge dimension": json.dumps({"inputs": [{
                "name": "dense", "datatype": "FP32", "shape": [0, 2**62], "data": []}]}).encode()}


def _assert_4xx(where: str, status: int, body: bytes, *, json_body: bool = True) -> None:
    assert 400 <= status < 500, f"{where}: {status} {body[:300]!r}"
    if json_body:
        doc = json.loads(body)
        assert doc, f"{where}: an empty JSON error"


def test_every_port_answers_hostile_bodies_with_a_4xx_and_keeps_serving(torchserve, sidecar):
    auth = {"Authorization": f"Bearer {sidecar.token}"}
    oip_infer = f"{sidecar.oip_url}/v2/models/dlrm/infer"
    targets = [
        # (name, url, method, headers, oversize bytes past the edge's limit, JSON errors?)
        ("8080 predict", torchserve.predict_url, "POST", {}, 2 * 2**20, False),
        ("8090 PUT /state (read port)", f"{sidecar.url}/state", "PUT", auth, 2**20, True),
        ("8091 PUT /state", f"{sidecar.write_url}/state", "PUT", auth, 2**20, True),
        ("8091 PUT /batching", f"{sidecar.write_url}/batching", "PUT", auth, 2**20, True),
        ("8091 POST /feedback", f"{sidecar.write_url}/feedback", "POST", auth, 9 * 2**20,
         True),
        ("8092 infer", oip_infer, "POST", {}, 5 * 2**20, True),
    ]
    seen: dict[str, int] = {}
    for name, url, method, headers, big, json_errors in targets:
        for case, body in _cases(big).items():
            status, text = _send(url, method, body, headers)
            where = f"{name} {case}"
            # TorchServe's own 413 (oversized) and 400s have an empty or non-JSON body
            _assert_4xx(where, status, text, json_body=json_errors and status != 413)
            seen[where] = status
    assert len(seen) == 5 * len(targets)
    # nothing broke: the sidecar, the OIP and TorchServe still answer
    status, _ = _send(f"{sidecar.url}/healthz", "GET", b"")
    assert status == 200
    status, _ = _send(f"{sidecar.oip_url}/v2/health/live", "GET", b"")
    assert status == 200
    status, text = _send(torchserve.predict_url, "POST",
                         json.dumps(example_request(4, seed=0)).encode())
    assert status == 200, text[:300]
    assert len(json.loads(text)["predictions"]) == 4
