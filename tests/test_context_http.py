"""The ranking (context) form over HTTP, through the real TorchServe and the real OIP
process: JSON rows, JSON columnar, binary version 2 and OIP (JSON and binary tensors) each
answer bit for bit what the same request sent as independent instances gets; bad context
requests get a 400 naming the part and the rule, never a 5xx."""
from __future__ import annotations

import httpx
import orjson
import pytest
import torch

from serve.api.binary import encode_binary, encode_binary_ranking
from serve.api.config import HandlerConfig
from serve.api.context_body import ranking_request
from serve.api.decode import parse_body
from serve.api.oip import CONTEXT_PREFIX, HEADER_LENGTH, encode_infer_request, oip_inputs
from serve.api.request import BINARY_MEDIA_TYPE
from serve.api.spec import DEFAULT_SPEC
from tests.fixtures.ranking import ranking_arrays

pytestmark = pytest.mark.integration

N = 48
USER = frozenset(f"C{i}" for i in range(1, 14))


def _ranking(n: int = N, seed: int = 0):
    """Instance arrays of n candidates sharing C1..C13 and the dense vector (multi-hot,
    ids anywhere in int64's hashed range)."""
    return ranking_arrays(DEFAULT_SPEC, n, seed, USER, id_high=2**40)


def _post(url: str, body: bytes, ctype: str = "application/json") -> httpx.Response:
    return httpx.post(url, content=body, headers={"Content-Type": ctype}, timeout=60)


def _probs(r: httpx.Response) -> torch.Tensor:
    assert r.status_code == 200, r.text
    # our API writes float32 scores as their shortest decimals: float64 -> float32 is exact
    return torch.tensor(r.json()["predictions"], dtype=torch.float64).float()


def test_every_encoding_of_the_context_equals_the_instances(torchserve, sidecar):
    arrays = _ranking()
    url = torchserve.predict_url
    want = _probs(_post(url, encode_binary(*arrays), BINARY_MEDIA_TYPE))
    assert want.shape == (N,)
    got = {}
    for form in ("rows", "columnar"):
        doc = ranking_request(*arrays, USER, dense_in_context=True, spec=DEFAULT_SPEC,
                              form=form)
        got[form] = _probs(_post(url, orjson.dumps(doc)))
    doc = ranking_request(*arrays, USER, dense_in_context=True, spec=DEFAULT_SPEC)
    p = parse_body(orjson.dumps(doc), HandlerConfig())
    body = encode_binary_ranking(p.dense[:1], p.lengths, p.values, p.shared, dense_shared=True)
    got["binary"] = _probs(_post(url, body, BINARY_MEDIA_TYPE))
    for binary in (False, True):
        inputs = oip_inputs(*arrays, multi_hot=True)
        for name in USER:
            f = DEFAULT_SPEC.names.index(name)
            inputs[CONTEXT_PREFIX + name] = inputs.pop(name)[:int(arrays[1][f, 0])]
            inputs.pop(name + ".lengths")
        inputs[CONTEXT_PREFIX + "dense"] = inputs.pop("dense")[:1]
        raw, hl = encode_infer_request(inputs, binary=binary)
        r = httpx.post(f"{sidecar.oip_url}/v2/models/dlrm/infer", content=raw, timeout=60,
                       headers={HEADER_LENGTH: str(hl)} if hl is not None else {})
        assert r.status_code == 200, r.text
        out = torch.tensor(r.json()["outputs"][0]["data"], dtype=torch.float32)
        got[f"oip-{'binary' if binary else 'json'}"] = out
    for name, probs in got.items():
        assert torch.equal(probs, want), name


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["candidates"][0]["sparse"].__setitem__("C1", [1]),
     "features C1 are also in context.sparse"),
    (lambda d: d.__setitem__("candidates", []), "candidates: is empty"),
    (lambda d: d["context"]["sparse"].__setitem__("C2", list(range(65))), "context.sparse.C2"),
    (lambda d: d["candidates"][0].__setitem__("dense", [0.0] * 13), "unknown keys ['dense']"),
    (lambda d: d["context"].pop("dense"), "missing keys ['dense']"),
], ids=["feature-in-both", "no-candidates", "context-ids", "dense-in-both", "dense-in-neither"])
def test_bad_context_requests_are_400_naming_the_part(torchserve, mutate, match):
    doc = ranking_request(*_ranking(4, 1), USER, dense_in_context=True, spec=DEFAULT_SPEC)
    mutate(doc)
    r = _post(torchserve.predict_url, orjson.dumps(doc))
    assert r.status_code == 400, r.text
    assert match in r.json()["message"]
    ok = _post(torchserve.predict_url, orjson.dumps(
        ranking_request(*_ranking(4, 1), USER, dense_in_context=True, spec=DEFAULT_SPEC)))
    assert ok.status_code == 200
