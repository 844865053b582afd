"""The ranking (context) form of the predict API: parsing, errors naming the part and the
rule, merging with other requests, and exactness (torch.equal) against the same requests
sent as independent instances, through handle_batch and a real (tiny) runtime."""
from __future__ import annotations

import copy

import numpy as np
import orjson
import pytest

from serve.api.batch import merge_requests
from serve.api.config import HandlerConfig
from serve.api.context_body import ranking_request
from serve.api.decode import parse_body
from serve.api.spec import DEFAULT_SPEC
from serve.errors import InvalidInput, PayloadTooLarge
from serve.worker.arms import handle_batch
from tests.fixtures.ranking import instances_body
from tests.fixtures.ranking import ranking_arrays as fixture_arrays

CFG = HandlerConfig(max_instances=64, max_ids_per_feature=8, max_body_bytes=1_000_000)
USER = frozenset(f"C{i}" for i in range(1, 14))      # the context half


def ranking_arrays(n: int, seed: int, context=USER, dense_ctx: bool = True):
    """Instance-form arrays of n candidates sharing ``context`` (and the dense vector)."""
    return fixture_arrays(DEFAULT_SPEC, n, seed, context, dense_ctx=dense_ctx)


def _instances(dense, lengths, values) -> dict:
    return instances_body(DEFAULT_SPEC, dense, lengths, values)


@pytest.mark.parametrize("form", ["rows", "columnar"])
@pytest.mark.parametrize("dense_ctx", [True, False])
def test_context_parses_to_the_instances_with_shared_bags(form, dense_ctx):
    arrays = ranking_arrays(9, 3, dense_ctx=dense_ctx)
    doc = ranking_request(*arrays, USER, dense_in_context=dense_ctx, spec=DEFAULT_SPEC,
                          form=form)
    got = parse_body(orjson.dumps(doc), CFG)
    want = parse_body(orjson.dumps(_instances(*arrays)), CFG)
    assert got.shared == tuple(range(13)) and want.shared == ()
    np.testing.assert_array_equal(got.dense, want.dense)
    # candidate features: as the instances; context features: once, in candidate 0's cell
    np.testing.assert_array_equal(got.lengths[13:], want.lengths[13:])
    np.testing.assert_array_equal(got.lengths[:13, 0], want.lengths[:13, 0])
    assert not got.lengths[:13, 1:].any()
    assert got.values.size < want.values.size


def test_one_candidate_is_the_instance_form_exactly():
    arrays = ranking_arrays(1, 4)
    doc = ranking_request(*arrays, USER, dense_in_context=True, spec=DEFAULT_SPEC)
    got = parse_body(orjson.dumps(doc), CFG)
    want = parse_body(orjson.dumps(_instances(*arrays)), CFG)
    assert got.shared == ()
    for a, b in ((got.dense, want.dense), (got.lengths, want.lengths), (got.values, want.values)):
        np.testing.assert_array_equal(a, b)


def test_merge_keeps_each_requests_bags():
    a = parse_body(orjson.dumps(ranking_request(*ranking_arrays(3, 5), USER,
                                                dense_in_context=True, spec=DEFAULT_SPEC)), CFG)
    b = parse_body(orjson.dumps(_instances(*ranking_arrays(2, 6))), CFG)
    c = parse_body(orjson.dumps(ranking_request(*ranking_arrays(4, 7, context={"C2", "C20"}),
                                                {"C2", "C20"}, dense_in_context=True,
                                                spec=DEFAULT_SPEC)), CFG)
    m = merge_requests([a, b, c])
    assert m.shared == tuple(sorted(set(range(13)) | {19}))
    assert m.bag_of is not None and m.bag_of.shape == (len(m.shared), 9)
    c2 = m.shared.index(1)    # C2: shared by a (samples 0..2) and c (5..8), not b
    assert m.bag_of[c2].tolist() == [0, 0, 0, 3, 4, 5, 5, 5, 5]
    c20 = m.shared.index(19)  # C20: only c shares it
    assert m.bag_of[c20].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]


@pytest.fixture(scope="module")
def tiny_runtime(tmp_path_factory):
    from serve.runtime.engine import Runtime, RuntimeConfig
    from tests.fixtures.torchserve import tiny_random_artifact

    path = tiny_random_artifact(tmp_path_factory.mktemp("ctx") / "a.pt")
    return Runtime.from_artifact(path, RuntimeConfig(device="cpu", num_threads=1))


def _forward(runtime):
    return lambda m: runtime.predict_arrays(m.dense, m.values, m.lengths, m.shared, m.bag_of)


@pytest.mark.parametrize("form", ["rows", "columnar"])
def test_a_batch_of_context_requests_equals_the_instances(tiny_runtime, form):
    """Context and instance requests mixed in one TorchServe batch: each answer bit for
    bit what its expanded form gets."""
    reqs = [(ranking_arrays(5, 11), USER, True), (ranking_arrays(1, 12), USER, True),
            (ranking_arrays(7, 13, dense_ctx=False), USER, False),
            (ranking_arrays(3, 14, context={"C5"}), {"C5"}, True)]
    bodies = [orjson.dumps(ranking_request(*a, ctx, dense_in_context=d, spec=DEFAULT_SPEC,
                                           form=form)) for a, ctx, d in reqs]
    plain = [orjson.dumps(_instances(*a)) for a, _, _ in reqs]
    bodies.insert(2, plain[0])
    out, _ = handle_batch(bodies, [None] * len(bodies), _forward(tiny_runtime), CFG)
    want, _ = handle_batch(plain, [None] * len(plain), _forward(tiny_runtime), CFG)
    assert [o.status for o in out] == [200] * len(bodies)
    got = [orjson.loads(o.body)["predictions"] for o in out]
    assert got[2] == got[0]
    del got[2]
    assert got == [orjson.loads(o.body)["predictions"] for o in want]


def _ctx_doc(n: int = 3) -> dict:
    return ranking_request(*ranking_arrays(n, 21), USER, dense_in_context=True,
                           spec=DEFAULT_SPEC)


def _bad(f) -> bytes:
    d = copy.deepcopy(_ctx_doc())
    f(d)
    return orjson.dumps(d)


BAD = [
    ("feature in both parts", _bad(lambda d: d["candidates"][1]["sparse"].__setitem__("C1", [3])),
     InvalidInput, r"candidates\[1\]\.sparse: features C1 are also in context\.sparse"),
    ("feature in neither", _bad(lambda d: d["context"]["sparse"].pop("C2")),
     InvalidInput, r"candidates\[0\]\.sparse: features C2 are in neither part"),
    ("no candidates", _bad(lambda d: d.__setitem__("candidates", [])),
     InvalidInput, r"candidates: is empty"),
    ("too many candidates", _bad(lambda d: d.__setitem__("candidates", d["candidates"] * 30)),
     PayloadTooLarge, r"candidates: 90 instances exceed the limit of 64"),
    ("too many context ids", _bad(lambda d: d["context"]["sparse"].__setitem__("C3", [1] * 9)),
     InvalidInput, r"context\.sparse\.C3: has 9 ids; .*8"),
    ("dense in both", _bad(lambda d: d["candidates"][0].__setitem__("dense", [0.0] * 13)),
     InvalidInput, r"candidates\[0\]: unknown keys \['dense'\]"),
    ("dense in neither", _bad(lambda d: d["context"].pop("dense")),
     InvalidInput, r"candidates\[0\]: missing keys \['dense'\]"),
    ("unknown context feature", _bad(lambda d: d["context"]["sparse"].__setitem__("X9", [1])),
     InvalidInput, r"context\.sparse: unknown features X9"),
    ("context not an object", _bad(lambda d: d.__setitem__("context", [1])),
     InvalidInput, r"context: is a JSON array"),
    ("negative context id", _bad(lambda d: d["context"]["sparse"].__setitem__("C4", [-1])),
     InvalidInput, r"context\.sparse\.C4\[0\]"),
    ("context dense short", _bad(lambda d: d["context"].__setitem__("dense", [1.0])),
     InvalidInput, r"context\.dense: has 1 values; it must have exactly 13"),
    ("extra top key", _bad(lambda d: d.__setitem__("instances", [])),
     InvalidInput, r"unknown keys \['instances'\]"),
    ("everything in context", orjson.dumps({"context": {"dense": [0.0] * 13, "sparse": {
        n: [1] for n in DEFAULT_SPEC.names}}, "candidates": [{}]}),
     InvalidInput, r"context: holds every feature"),
]


@pytest.mark.parametrize("name,body,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_context_requests_name_the_part_and_rule(name, body, exc, match):
    with pytest.raises(exc, match=match):
        parse_body(body, CFG)


def test_columnar_candidates_errors_name_the_part():
    doc = ranking_request(*ranking_arrays(3, 22), USER, dense_in_context=True,
                          spec=DEFAULT_SPEC, form="columnar")
    doc["candidates"]["sparse"]["C20"]["lengths"] = [1, 1]
    with pytest.raises(InvalidInput, match=r"candidates\.sparse\.C20\.lengths: has 2 entries; "
                                           r"it must have one per candidate \(3\)"):
        parse_body(orjson.dumps(doc), CFG)
    doc["candidates"]["sparse"]["C1"] = {"values": [1, 2, 3], "lengths": [1, 1, 1]}
    with pytest.raises(InvalidInput, match=r"candidates\.sparse: features C1 are also in"):
        parse_body(orjson.dumps(doc), CFG)


# -- binary version 2 ----------------------------------------------------------------------

def _binary_pair(n: int, seed: int, context=USER, dense_ctx=True):
    from serve.api.binary import encode_binary, encode_binary_ranking

    arrays = ranking_arrays(n, seed, context=context, dense_ctx=dense_ctx)
    p = parse_body(orjson.dumps(ranking_request(*arrays, context, dense_in_context=dense_ctx,
                                                spec=DEFAULT_SPEC)), CFG)
    dense = p.dense[:1] if dense_ctx else p.dense
    ranking = encode_binary_ranking(dense, p.lengths, p.values, p.shared,
                                    dense_shared=dense_ctx)
    return ranking, encode_binary(*arrays), p


@pytest.mark.parametrize("dense_ctx", [True, False])
def test_binary_ranking_parses_as_the_json_context(dense_ctx):
    from serve.api.request import BINARY_MEDIA_TYPE

    ranking, plain, want = _binary_pair(6, 31, dense_ctx=dense_ctx)
    got = parse_body(ranking, CFG, BINARY_MEDIA_TYPE)
    assert got.shared == want.shared == tuple(range(13))
    for a, b in ((got.dense, want.dense), (got.lengths, want.lengths), (got.values, want.values)):
        np.testing.assert_array_equal(a, b)
    assert len(ranking) < len(plain)


def test_binary_ranking_equals_the_instances(tiny_runtime):
    from serve.api.request import BINARY_MEDIA_TYPE

    bodies, plain = [], []
    for seed, ctx in ((41, USER), (42, {"C1", "C26"}), (43, USER)):
        r, p, _ = _binary_pair(5, seed, context=ctx)
        bodies.append(r)
        plain.append(p)
    ct = [BINARY_MEDIA_TYPE] * 3
    out, _ = handle_batch(bodies, ct, _forward(tiny_runtime), CFG)
    want, _ = handle_batch(plain, ct, _forward(tiny_runtime), CFG)
    assert [o.status for o in out] == [200] * 3
    assert [o.body for o in out] == [o.body for o in want]


@pytest.mark.parametrize("offset,value,match", [
    (4, 3, r"version is 3; versions 1 \(instances\) and 2"),
    (20, 2, r"parts are 2 \(dense\)"),
    (24, 7, r"each must be 0 \(per candidate\) or 1 \(context\)"),
])
def test_bad_binary_ranking_headers(offset, value, match):
    from serve.api.request import BINARY_MEDIA_TYPE

    ranking, _, _ = _binary_pair(3, 44)
    raw = bytearray(ranking)
    raw[offset] = value
    with pytest.raises(InvalidInput, match=match):
        parse_body(bytes(raw), CFG, BINARY_MEDIA_TYPE)


def test_binary_ranking_context_cap_and_size():
    from serve.api.binary import encode_binary_ranking
    from serve.api.request import BINARY_MEDIA_TYPE

    _, _, p = _binary_pair(3, 45)
    ln = p.lengths.copy()
    ln[0, 0] = 9                           # C1 in the context: 9 ids, the cap is 8
    vals = np.concatenate([np.arange(9), p.values[int(p.lengths[0, 0]):]])
    body = encode_binary_ranking(p.dense[:1], ln, vals, p.shared, dense_shared=True)
    with pytest.raises(InvalidInput, match=r"lengths\[C1\]\[0\] is 9; .*8"):
        parse_body(body, CFG, BINARY_MEDIA_TYPE)
    good, _, _ = _binary_pair(3, 45)
    with pytest.raises(InvalidInput, match="bytes"):
        parse_body(good[:-8], CFG, BINARY_MEDIA_TYPE)


# -- Open Inference Protocol ---------------------------------------------------------------

def _oip_ranking(arrays, context, dense_ctx, binary):
    from serve.api.oip import CONTEXT_PREFIX, encode_infer_request, oip_inputs

    dense, lengths, values = arrays
    inputs = oip_inputs(dense, lengths, values, multi_hot=True)
    for name in context:
        inputs[CONTEXT_PREFIX + name] = inputs.pop(name)[:int(lengths[DEFAULT_SPEC.names.index(name), 0])]
        inputs.pop(name + ".lengths")
    if dense_ctx:
        inputs[CONTEXT_PREFIX + "dense"] = inputs.pop("dense")[:1]
    return encode_infer_request(inputs, binary=binary)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("dense_ctx", [True, False])
def test_oip_context_inputs_equal_the_instances(tiny_runtime, binary, dense_ctx):
    from serve.api.oip import parse_infer, to_predict_body
    from serve.api.request import BINARY_MEDIA_TYPE

    arrays = ranking_arrays(6, 51, dense_ctx=dense_ctx)
    body, hl = _oip_ranking(arrays, USER, dense_ctx, binary)
    req = parse_infer(body, cfg=CFG, header_length=hl)
    assert req.parsed.shared == tuple(range(13))
    fwd = to_predict_body(req)
    assert fwd[4] == 2        # forwarded as binary version 2
    from serve.api.binary import encode_binary
    out, _ = handle_batch([fwd, encode_binary(*arrays)], [BINARY_MEDIA_TYPE] * 2,
                          _forward(tiny_runtime), CFG)
    assert out[0].status == 200 and out[0].body == out[1].body


def test_oip_context_errors_name_the_input():
    from serve.api.oip import CONTEXT_PREFIX, encode_infer_request, oip_inputs, parse_infer

    arrays = ranking_arrays(3, 52)
    inputs = oip_inputs(*arrays, multi_hot=True)
    inputs[CONTEXT_PREFIX + "C1"] = np.array([1, 2], dtype=np.int64)
    body, _ = encode_infer_request(inputs)
    with pytest.raises(InvalidInput, match=r"inputs C1: are also given as context\.<name>"):
        parse_infer(body, cfg=CFG)
    del inputs["C2"], inputs["C2.lengths"], inputs["C1"], inputs["C1.lengths"]
    body, _ = encode_infer_request(inputs)
    with pytest.raises(InvalidInput, match=r"missing inputs C2: each input goes per candidate"):
        parse_infer(body, cfg=CFG)
    inputs[CONTEXT_PREFIX + "C2"] = np.arange(9, dtype=np.int64)
    body, _ = encode_infer_request(inputs)
    with pytest.raises(InvalidInput, match=r"input context\.C2: has 9 ids; .*8"):
        parse_infer(body, cfg=CFG)


@pytest.mark.parametrize("mode", ["canary", "shadow"])
def test_in_a_rollout_each_context_request_stays_in_one_arm(tmp_path, tiny_runtime, mode):
    """Two real runtimes as stable and candidate: a context request's candidates are all
    scored by its arm (its route key decides), and equal its instances scored there."""
    from serve.runtime.engine import Runtime, RuntimeConfig
    from serve.worker.arms import Split
    from tests.fixtures.torchserve import tiny_random_artifact

    other = Runtime.from_artifact(tiny_random_artifact(tmp_path / "b.pt", seed=5),
                                  RuntimeConfig(device="cpu", num_threads=1))
    keys = ["u1", "u2", "u3", "u4"]
    reqs = [ranking_arrays(n, 60 + i) for i, n in enumerate((6, 3, 9, 4))]
    ctx = [orjson.dumps(ranking_request(*a, USER, dense_in_context=True, spec=DEFAULT_SPEC))
           for a in reqs]
    inst = [orjson.dumps(_instances(*a)) for a in reqs]
    split = Split(mode, _forward(other), lambda k: k in ("u2", "u3"))
    out, info = handle_batch(ctx, [None] * 4, _forward(tiny_runtime), CFG, route_keys=keys,
                             split=split)
    assert [o.status for o in out] == [200] * 4
    for o, key, body in zip(out, keys, inst, strict=True):
        arm = "candidate" if mode == "canary" and key in ("u2", "u3") else "stable"
        assert o.arm == arm
        fwd = _forward(other if arm == "candidate" else tiny_runtime)
        want, _ = handle_batch([body], [None], fwd, CFG)
        assert o.body == want[0].body, key
    if mode == "shadow":       # the candidate scored the chosen requests, whole, too
        assert info.arms["candidate"].sizes == [3, 9]
