"""serve.api (request, spec, json_body, binary, decode, batch) and serve.worker.arms's
handle_batch: parsing, validation wording, merging, and one-forward batches (no server)."""
from __future__ import annotations

import copy
import re
import struct

import numpy as np
import orjson
import pytest

from serve.api import json_body, request
from serve.api import spec as api_spec
from serve.api.batch import merge_requests
from serve.api.binary import encode_binary, example_binary
from serve.api.config import HandlerConfig, default_num_threads
from serve.api.decode import parse_body
from serve.api.json_body import example_request
from serve.api.request import (
    BINARY_MEDIA_TYPE,
    INT64_MAX,
    JSON_MEDIA_TYPE,
    check_content_type,
)
from serve.api.spec import spec_of
from serve.errors import (
    ConfigError,
    InvalidInput,
    PayloadTooLarge,
    ServeError,
    UnsupportedMediaType,
)
from serve.model.archive import build_mar, model_config
from serve.ops.launch_config import LaunchConfig
from serve.ops.launch_processes import render_ts_config
from serve.profiles import SPARSE_FEATURES, get_profile
from serve.schema import FeatureSpec, ModelSchema, TableSpec
from serve.worker.arms import handle_batch

CFG = HandlerConfig(max_instances=4, max_ids_per_feature=3, max_body_bytes=100_000)


def _rows(n: int = 2, seed: int = 1) -> dict:
    return example_request(n, seed=seed)


def _mut(f, base=None) -> bytes:
    d = copy.deepcopy(base if base is not None else _rows())
    f(d)
    return orjson.dumps(d)


def _set_ids(i: int, feat: str, ids) -> bytes:
    return _mut(lambda d: d["instances"][i]["sparse"].__setitem__(feat, ids))


def _set_dense(i: int, j: int, v) -> bytes:
    return _mut(lambda d: d["instances"][i]["dense"].__setitem__(j, v))


ID_RULE = r"ids must be JSON integers in \[0, 2\^63-1\]"
DENSE_RULE = "dense values must be finite JSON numbers within float32 range"

BAD = [
    ("invalid json", b'{"instances": [', InvalidInput,
     (r"^body is not valid JSON \(unexpected end of data: line 1 column 16 \(char 15\)\); "
      r"send UTF-8 JSON \(NaN and Infinity are not JSON numbers\)$")),
    ("NaN literal", b'{"instances": [{"dense": [NaN]}]}', InvalidInput,
     r"^body is not valid JSON \(unexpected character"),
    ("Infinity as 1e999", b'{"instances": [{"dense": [1e999]}]}', InvalidInput,
     r"^body is not valid JSON \(number is infinity when parsed as double"),
    ("top-level array", b"[1, 2]", InvalidInput,
     r'^body is a JSON array; expected an object \{"instances": \[...\]\} \(rows\) or '),
    ("unknown top-level keys", b'{"foo": 1}', InvalidInput, r"^body has keys \['foo'\]; expected "),
    ("extra key beside instances", _mut(lambda d: d.update(foo=1)), InvalidInput,
     r'^body: unknown keys \[\'foo\'\] next to "instances"'),
    ("instances not a list", b'{"instances": {}}', InvalidInput,
     r"^instances: is a JSON object; expected an array of objects"),
    ("empty instances", b'{"instances": []}', InvalidInput,
     r"^instances: is empty; send 1 to 4 instances$"),
    ("too many instances", orjson.dumps(_rows(5)), PayloadTooLarge,
     r"^instances: 5 instances exceed the limit of 4 per request; split them over several"),
    ("instance not an object", b'{"instances": [3]}', InvalidInput,
     r"^instances\[0\]: is a JSON number; expected an object"),
    ("instance without dense", _mut(lambda d: d["instances"][1].pop("dense")), InvalidInput,
     r"^instances\[1\]: missing keys \['dense'\]; expected exactly \['dense', 'sparse'\]$"),
    ("missing feature", _mut(lambda d: d["instances"][1]["sparse"].pop("C7")), InvalidInput,
     (r"^instances\[1\].sparse: missing features C7; every instance needs exactly the sparse "
      r"features C1..C26 \(an empty list \[\] for no ids\)$")),
    ("unknown feature", _set_ids(0, "C27", [1]), InvalidInput,
     r"^instances\[0\].sparse: unknown features C27; every instance needs exactly"),
    ("dense too short", _mut(lambda d: d["instances"][1]["dense"].pop()), InvalidInput,
     (r"^instances\[1\].dense: has 12 values; it must have exactly 13 \(the model's dense "
      r"features\)$")),
    ("dense string", _set_dense(1, 4, "abc"), InvalidInput,
     rf'^instances\[1\].dense\[4\]: "abc" is a string, not a number; {DENSE_RULE}$'),
    ("dense null", _set_dense(0, 0, None), InvalidInput,
     rf"^instances\[0\].dense\[0\]: null is not a number; {DENSE_RULE}$"),
    ("dense bool", _set_dense(0, 0, True), InvalidInput,
     rf"^instances\[0\].dense\[0\]: true is a boolean, not a number; {DENSE_RULE}$"),
    ("dense beyond float32", _set_dense(1, 2, 1e39), InvalidInput,
     rf"^instances\[1\].dense\[2\]: 1e\+39 is outside float32 range; {DENSE_RULE}$"),
    ("negative id", _set_ids(1, "C7", [-5]), InvalidInput,
     r"^instances\[1\].sparse.C7\[0\]: -5 is negative; ids must be integers >= 0$"),
    ("fractional id", _set_ids(1, "C7", [3, 1.5]), InvalidInput,
     rf"^instances\[1\].sparse.C7\[1\]: 1.5 is not an integer; {ID_RULE} \(no decimal point"),
    ("float id 1.0", _set_ids(1, "C7", [1.0]), InvalidInput,
     rf"^instances\[1\].sparse.C7\[0\]: 1.0 is not an integer; {ID_RULE}"),
    ("id 2^63", _set_ids(0, "C26", [2**63]), InvalidInput,
     (rf"^instances\[0\].sparse.C26\[0\]: 9223372036854775808 is greater than 2\^63-1 "
      rf"\(9223372036854775807\); {ID_RULE}$")),
    ("id 2^64-1", _set_ids(0, "C26", [2**64 - 1]), InvalidInput,
     r"^instances\[0\].sparse.C26\[0\]: 18446744073709551615 is greater than 2\^63-1"),
    ("id beyond 64 bits", b'{"instances": [{"dense": [1,1,1,1,1,1,1,1,1,1,1,1,1], "sparse": {'
     + b", ".join(f'"{f}": [{2**70 if f == "C2" else 1}]'.encode() for f in SPARSE_FEATURES)
     + b"}}]}", InvalidInput,
     (rf"^instances\[0\].sparse.C2\[0\]: 1.1805916207174113e\+21 is beyond the 64-bit integer "
      rf"range; {ID_RULE}$")),
    ("string id", _set_ids(0, "C1", ["7"]), InvalidInput,
     rf'^instances\[0\].sparse.C1\[0\]: "7" is a string, not an integer; {ID_RULE}$'),
    ("bool id", _set_ids(0, "C1", [True]), InvalidInput,
     rf"^instances\[0\].sparse.C1\[0\]: true is a boolean, not an integer; {ID_RULE}$"),
    ("ids not a list", _set_ids(0, "C2", 7), InvalidInput,
     r"^instances\[0\].sparse.C2: is a JSON number; expected an array of ids, e.g. \[42\]$"),
    ("too many ids", _set_ids(1, "C3", [1, 2, 3, 4]), InvalidInput,
     r"^instances\[1\].sparse.C3: has 4 ids; at most 3 ids per feature are allowed; "),
    ("huge body", b" " * 100_001, PayloadTooLarge,
     r"^body is 100001 bytes; the limit is 100000 bytes; split the instances"),
    ("empty body", b"", InvalidInput, r"^body is empty; send a JSON object"),
]


@pytest.mark.parametrize("name,body,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_rows_are_rejected_with_the_field_and_rule(name, body, exc, match):
    with pytest.raises(exc, match=match):
        parse_body(body, CFG)


def _col(f) -> bytes:
    return _mut(f, example_request(2, seed=1, form="columnar"))


BAD_COLUMNAR = [
    ("lengths count", _col(lambda d: d["sparse"]["C3"].__setitem__("lengths", [1])),
     r"^sparse.C3.lengths: has 1 entries; it must have one per dense row \(2\)$"),
    ("lengths vs values", _col(lambda d: d["sparse"]["C3"].__setitem__("lengths", [1, 2])),
     r"^sparse.C3: lengths sum to 3 but values has 2 ids; they must be equal$"),
    ("negative id", _col(lambda d: d["sparse"]["C3"].__setitem__("values", [1, -2])),
     r"^sparse.C3.values\[1\]: -2 is negative; ids must be integers >= 0$"),
    ("negative length", _col(lambda d: d["sparse"]["C3"].__setitem__("lengths", [-1, 3])),
     r"^sparse.C3.lengths\[0\]: -1 is not a count; lengths must be integers >= 0$"),
    ("missing lengths", _col(lambda d: d["sparse"]["C3"].pop("lengths")),
     r"^sparse.C3: missing keys \['lengths'\]; expected exactly \['lengths', 'values'\]$"),
    ("dense row length", _col(lambda d: d["dense"][0].append(1)),
     r"^dense\[0\]: has 14 values; it must have exactly 13 \(the model's dense features\)$"),
    ("missing feature", _col(lambda d: d["sparse"].pop("C26")),
     r"^sparse: missing features C26; every instance needs exactly"),
    ("too many ids", _col(lambda d: d["sparse"]["C4"].update(values=[1, 2, 3, 4, 5],
                                                            lengths=[1, 4])),
     r"^sparse.C4.lengths\[1\]: has 4 ids; at most 3 ids per feature are allowed"),
]


@pytest.mark.parametrize("name,body,match", BAD_COLUMNAR, ids=[b[0] for b in BAD_COLUMNAR])
def test_bad_columnar_is_rejected(name, body, match):
    with pytest.raises(InvalidInput, match=match):
        parse_body(body, CFG)


@pytest.mark.parametrize("ctype", [None, "", "application/json", "application/json; charset=utf-8",
                                   "Application/JSON;charset=UTF-8"])
def test_json_content_types_are_accepted(ctype):
    assert check_content_type(ctype) == JSON_MEDIA_TYPE


@pytest.mark.parametrize("ctype", ["application/x-dlrm-columnar", "Application/X-DLRM-Columnar",
                                   b"application/x-dlrm-columnar", " application/x-dlrm-columnar "])
def test_binary_content_type_is_accepted(ctype):
    assert check_content_type(ctype) == BINARY_MEDIA_TYPE


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "application/json; charset=latin-1", "multipart/form-data",
                                   "application/octet-stream", "application/x-dlrm-columnar; v=1",
                                   "application/x-dlrm-columnar; charset=utf-8"])
def test_other_content_types_get_415(ctype):
    with pytest.raises(UnsupportedMediaType) as e:
        check_content_type(ctype)
    assert e.value.message == (
        f"Content-Type '{ctype}' is not supported; send the body as JSON with 'Content-Type: "
        "application/json' (charset utf-8), or binary columnar with 'Content-Type: "
        "application/x-dlrm-columnar'")


def test_ids_are_exact_up_to_int64_max_and_layout_is_feature_major():
    body = _rows(2)
    body["instances"][0]["sparse"]["C1"] = [INT64_MAX, 45821459, 2**53 + 1]
    body["instances"][1]["sparse"]["C1"] = []
    body["instances"][1]["sparse"]["C2"] = [7, 8]
    p = parse_body(orjson.dumps(body), CFG)
    assert p.dense.dtype == np.float32 and p.dense.shape == (2, 13)
    assert p.lengths.dtype == np.int32 and p.lengths.shape == (26, 2)
    assert p.values.dtype == np.int64
    assert p.lengths[:2].tolist() == [[3, 0], [1, 2]]
    c2_first = body["instances"][0]["sparse"]["C2"][0]
    assert p.values[:6].tolist() == [INT64_MAX, 45821459, 2**53 + 1, c2_first, 7, 8]
    assert p.values.shape[0] == int(p.lengths.sum())
    np.testing.assert_array_equal(
        p.dense, np.array([i["dense"] for i in body["instances"]], dtype=np.float32))


def test_rows_and_columnar_parse_identically():
    a = parse_body(orjson.dumps(example_request(3, seed=5)), CFG)
    b = parse_body(orjson.dumps(example_request(3, seed=5, form="columnar")), CFG)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.values, b.values)


def _multi_hot(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    body = example_request(n, seed=seed)
    for inst in body["instances"]:
        for f in SPARSE_FEATURES:
            inst["sparse"][f] = rng.integers(0, 10**6, size=int(rng.integers(0, 4))).tolist()
    return body


@pytest.mark.parametrize("shape", [((2, 1), (1, 2), (4, 3)),
                                   tuple((1 + s % 3, 10 + s) for s in range(24))])
def test_merge_equals_parsing_the_concatenated_request(shape):
    reqs = [_multi_hot(n, seed) for n, seed in shape]
    parsed = [parse_body(orjson.dumps(r), CFG) for r in reqs]
    merged = merge_requests(parsed)
    whole = parse_body(orjson.dumps({"instances": [i for r in reqs for i in r["instances"]]}),
                       HandlerConfig(max_instances=100, max_ids_per_feature=3))
    assert merged.sizes == [n for n, _ in shape]
    np.testing.assert_array_equal(merged.dense, whole.dense)
    np.testing.assert_array_equal(merged.lengths, whole.lengths)
    np.testing.assert_array_equal(merged.values, whole.values)


@pytest.fixture(scope="module")
def tiny_runtime(tmp_path_factory):
    from serve.runtime.engine import Runtime, RuntimeConfig
    from tests.fixtures.torchserve import tiny_random_artifact

    path = tiny_random_artifact(tmp_path_factory.mktemp("proto") / "a.pt")
    return Runtime.from_artifact(path, RuntimeConfig(device="cpu", cache_load_factor=1.0,
                                                     num_threads=1))


def _predict_with(runtime):
    def predict(m):
        return runtime.predict_arrays(m.dense, m.values, m.lengths)
    return predict


def _counting_predict(runtime):
    """(calls, predict): predict runs the runtime and records each forward's request sizes."""
    calls: list = []
    predict = _predict_with(runtime)

    def counting(m):
        calls.append(m.sizes)
        return predict(m)
    return calls, counting


def test_one_forward_for_the_batch_and_bad_requests_fail_alone(tiny_runtime):

    reqs = [_multi_hot(2, 11), _multi_hot(3, 12), _multi_hot(1, 13)]
    bodies = [orjson.dumps(reqs[0]), _set_ids(1, "C7", [-5]), orjson.dumps(reqs[1]),
              b"not json", orjson.dumps(reqs[2])]
    ctypes = ["application/json", None, "application/json; charset=utf-8", None, "text/plain"]
    calls, counting = _counting_predict(tiny_runtime)
    outs, info = handle_batch(bodies, ctypes, counting, CFG)
    assert calls == [[2, 3]]  # one forward: the two good requests
    assert info.instances == 5 and info.requests == 2
    assert [o.status for o in outs] == [200, 400, 200, 400, 415]
    assert orjson.loads(outs[1].body) == {
        "code": 400, "type": "InvalidInput",
        "message": "instances[1].sparse.C7[0]: -5 is negative; ids must be integers >= 0"}
    assert orjson.loads(outs[4].body)["type"] == "UnsupportedMediaType"
    for out, req in ((outs[0], reqs[0]), (outs[2], reqs[1])):
        p = parse_body(orjson.dumps(req), CFG)
        alone = tiny_runtime.predict_arrays(p.dense, p.values, p.lengths)
        got = np.array(orjson.loads(out.body)["predictions"], dtype=np.float32)
        assert got.shape == alone.shape
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)
        assert ((got > 0) & (got < 1)).all()


def test_handler_config_validation():
    with pytest.raises(ConfigError, match=r"handler: unknown keys \['cache_size'\]; known keys"):
        HandlerConfig.from_dict({"cache_size": 3})
    with pytest.raises(ConfigError, match=r"handler.max_instances=0 must be an integer >= 1"):
        HandlerConfig(max_instances=0)
    with pytest.raises(ConfigError,
                       match=r"handler.cache_load_factor=1.5 must be a number in \(0, 1\] or null"):
        HandlerConfig(cache_load_factor=1.5)
    with pytest.raises(ConfigError, match=r"handler.cache_policy='fifo' must be 'lru' or 'lfu'"):
        HandlerConfig(cache_policy="fifo")
    assert HandlerConfig.from_dict(HandlerConfig(num_threads=2).to_dict()) == HandlerConfig(num_threads=2)


def test_debug_delay_is_off_by_default_and_bounded():
    assert HandlerConfig().debug_delay_ms == 0
    assert HandlerConfig.from_dict({"debug_delay_ms": 250}).debug_delay_ms == 250
    assert HandlerConfig(debug_delay_ms=10_000).debug_delay_ms == 10_000
    for bad in (-1, 10_001, 1.5, True, "5"):
        with pytest.raises(ConfigError) as info:
            HandlerConfig(debug_delay_ms=bad)
        assert info.value.message == (f"handler.debug_delay_ms={bad!r} must be an integer in "
                                      "0..10000 (ms slept per batch; for tests only)")


def test_default_threads_split_the_cores():
    assert default_num_threads(workers=2, cores=2) == 1
    assert default_num_threads(workers=1, cores=16) == 16
    assert default_num_threads(workers=4, cores=2) == 1


def test_model_config_and_bad_archive_settings(tmp_path):
    cfg = model_config(batch_size=16, max_batch_delay_ms=3, handler_config={"max_instances": 9})
    assert cfg["batchSize"] == 16 and cfg["maxBatchDelay"] == 3
    assert cfg["handler"]["max_instances"] == 9
    with pytest.raises(ConfigError, match=r"build_mar: batch_size=0 must be an integer >= 1"):
        model_config(batch_size=0)
    with pytest.raises(ConfigError, match=r"min_workers=3 > max_workers=2"):
        model_config(min_workers=3, max_workers=2)
    from serve.errors import ArtifactError
    with pytest.raises(ArtifactError, match=r"does not exist; build it with `make model`"):
        build_mar(tmp_path / "nope.pt", tmp_path)


def test_ts_config_render_replaces_ports_and_store(tmp_path):
    text = ("# c\ninference_address=http://127.0.0.1:8080\nmanagement_address=http://127.0.0.1:8081\n"
            "metrics_address=http://127.0.0.1:8082\nmodel_store=model_store\nload_models=dlrm=dlrm.mar\n"
            "job_queue_size=1000\n")
    cfg = LaunchConfig(inference_port=9001, management_port=9002, metrics_port=9003,
                       sidecar_port=9004, model_store=tmp_path, ts_overrides={"job_queue_size": "5",
                                                                             "max_request_size": "7"})
    out = render_ts_config(text, cfg)
    assert "inference_address=http://127.0.0.1:9001" in out
    assert "management_address=http://127.0.0.1:9002" in out
    assert "metrics_address=http://127.0.0.1:9003" in out
    assert f"model_store={tmp_path}" in out
    assert "load_models" not in out and "job_queue_size=5" in out and "max_request_size=7" in out
    with pytest.raises(ConfigError, match=r"must all differ"):
        LaunchConfig(inference_port=1, management_port=1)


def test_parse_pauses_the_garbage_collector_and_restores_it():
    import gc

    assert gc.isenabled()
    parse_body(orjson.dumps(example_request(2)), CFG)
    assert gc.isenabled()
    with pytest.raises(InvalidInput):
        parse_body(b"[", CFG)
    assert gc.isenabled()  # restored on the error path too
    gc.disable()
    try:
        parse_body(orjson.dumps(example_request(1)), CFG)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


# ----------------------------------------------------------------------------- binary form

def _columnar_json(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> bytes:
    """The same data as a JSON columnar body (the reference parse)."""
    ends = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))])
    return orjson.dumps({"dense": dense.tolist(), "sparse": {
        f: {"values": values[ends[fi]:ends[fi + 1]].tolist(), "lengths": lengths[fi].tolist()}
        for fi, f in enumerate(SPARSE_FEATURES)}})


def _multi_hot_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 dense (n, 13), lengths (26, n) in 0..3, ids up to INT64_MAX."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((n, 13)) * 100).astype(np.float32)
    dense[0, :3] = [np.finfo(np.float32).max, np.finfo(np.float32).tiny, -0.0]
    lengths = rng.integers(0, 4, size=(26, n)).astype(np.int32)
    values = rng.integers(0, INT64_MAX, size=int(lengths.sum()), dtype=np.int64, endpoint=True)
    values[:2] = [INT64_MAX, 45821459]
    return dense, lengths, values


def _assert_same(a, b) -> None:
    for name in ("dense", "lengths", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview], ids=["bytes", "bytearray",
                                                                      "memoryview"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_binary_round_trip_equals_the_json_columnar_parse(wrap, n):
    dense, lengths, values = _multi_hot_arrays(n, seed=n)
    body = encode_binary(dense, lengths, values)
    assert len(body) == 20 + 4 * n * 13 + 4 * 26 * n + 8 * int(lengths.sum())
    p = parse_body(wrap(body), CFG, BINARY_MEDIA_TYPE)
    _assert_same(p, parse_body(_columnar_json(dense, lengths, values), CFG))
    for a in (p.dense, p.lengths, p.values):  # torch.from_numpy needs neither warning nor copy
        assert a.flags.writeable and a.flags.aligned and a.flags.c_contiguous


def test_binary_views_a_writable_body_without_copying():
    body = bytearray(example_binary(3, seed=2))  # odd B: values start 8-aligned
    p = parse_body(body, CFG, BINARY_MEDIA_TYPE)
    for a in (p.dense, p.lengths, p.values):
        assert np.shares_memory(a, np.frombuffer(body, dtype=np.uint8))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_example_binary_is_example_request(n):
    b = parse_body(example_binary(n, seed=7), CFG, BINARY_MEDIA_TYPE)
    for form in ("rows", "columnar"):
        _assert_same(b, parse_body(orjson.dumps(example_request(n, seed=7, form=form)), CFG))


def _bin(n: int = 2, f=None) -> bytes:
    """example_binary(n) with its arrays changed by f(dense, lengths, values) -> values."""
    p = parse_body(example_binary(n, seed=1), HandlerConfig(), BINARY_MEDIA_TYPE)
    dense, lengths, values = p.dense.copy(), p.lengths.copy(), p.values.copy()
    if f is not None:
        values = f(dense, lengths, values)
    return encode_binary(dense, lengths, values)


def _header(field: str, value: int, n: int = 2) -> bytes:
    body = bytearray(_bin(n))
    struct.pack_into("<I", body, {"version": 4, "B": 8, "F": 12, "N": 16}[field], value)
    return bytes(body)


def _dense_at(i: int, j: int, v: float):
    def f(d, ln, vals):
        d[i, j] = v
        return vals
    return f


def _lengths_at(feature: str, s: int, v: int):
    def f(d, ln, vals):
        fi = SPARSE_FEATURES.index(feature)
        old = int(ln[fi, s])
        ln[fi, s] = v
        at = int(ln[:fi].sum()) + int(ln[fi, :s].sum())
        return np.concatenate([vals[:at], np.arange(v, dtype=np.int64), vals[at + old:]])
    return f


def _patch_length(body: bytes, feature: str, s: int, v: int, n: int = 2) -> bytes:
    """lengths[feature][s] = v written straight into the body (encode_binary refuses v < 0)."""
    out = bytearray(body)
    struct.pack_into("<i", out, 20 + 4 * n * 13 + 4 * (SPARSE_FEATURES.index(feature) * n + s), v)
    return bytes(out)


def _negative_id(d, ln, vals):
    ln[:] = 1
    ln[2, 1] = 3  # C3 of sample 1: ids at flat 5, 6, 7
    vals = np.arange(54, dtype=np.int64)
    vals[6] = -5
    return vals


_TWO = len(_bin(2))  # 20 + 104 + 208 + 8 * 52 = 748

BAD_BINARY = [
    ("empty", b"", InvalidInput,
     ("binary body: is 0 bytes; the header needs 20 bytes (magic b'DLRM', then uint32 version, "
      "B, F, N, little-endian)")),
    ("shorter than the header", b"DLRM\x01\x00\x00\x00", InvalidInput,
     ("binary body: is 8 bytes; the header needs 20 bytes (magic b'DLRM', then uint32 version, "
      "B, F, N, little-endian)")),
    ("wrong magic", b"XXXX" + _bin(2)[4:], InvalidInput,
     ("binary body: magic is b'XXXX'; expected b'DLRM' as the first 4 bytes (JSON bodies need "
      "'Content-Type: application/json')")),
    ("JSON sent as binary", orjson.dumps(example_request(1)), InvalidInput,
     ("binary body: magic is b'{\"in'; expected b'DLRM' as the first 4 bytes (JSON bodies need "
      "'Content-Type: application/json')")),
    ("version 3", _header("version", 3), InvalidInput,
     ("binary body: version is 3; versions 1 (instances) and 2 (ranking: a context) are "
      "supported")),
    ("version 0", _header("version", 0), InvalidInput,
     ("binary body: version is 0; versions 1 (instances) and 2 (ranking: a context) are "
      "supported")),
    ("F = 25", _header("F", 25), InvalidInput, "binary body: F is 25; it must be 26 (C1..C26)"),
    ("N = 14", _header("N", 14), InvalidInput,
     "binary body: N is 14; it must be 13 (the model's dense features)"),
    ("B = 0", _header("B", 0), InvalidInput, "binary body: B is 0; send 1 to 4 instances"),
    ("B over max_instances", _bin(5), PayloadTooLarge,
     ("binary body: B=5 instances exceed the limit of 4 per request; split them over several "
      "requests")),
    ("B = 2^32-1", _header("B", 2**32 - 1), PayloadTooLarge,
     ("binary body: B=4294967295 instances exceed the limit of 4 per request; split them over "
      "several requests")),
    ("truncated in lengths", _bin(2)[:100], InvalidInput,
     ("binary body: is 100 bytes; the header (B=2) needs at least 332 bytes for dense and "
      "lengths; send the whole body")),
    ("B larger than sent", _header("B", 4, n=1), InvalidInput,
     ("binary body: is 384 bytes; the header (B=4) needs at least 644 bytes for dense and "
      "lengths; send the whole body")),
    ("truncated by one byte", _bin(2)[:-1], InvalidInput,
     (f"binary body: is {_TWO - 1} bytes; the header (B=2, nnz=52) needs {_TWO} bytes; nnz is "
      "the sum of lengths and each id is 8 bytes")),
    ("one byte too many", _bin(2) + b"\x00", InvalidInput,
     (f"binary body: is {_TWO + 1} bytes; the header (B=2, nnz=52) needs {_TWO} bytes; nnz is "
      "the sum of lengths and each id is 8 bytes")),
    ("lengths say more ids than sent", _bin(2)[:-8], InvalidInput,
     (f"binary body: is {_TWO - 8} bytes; the header (B=2, nnz=52) needs {_TWO} bytes; nnz is "
      "the sum of lengths and each id is 8 bytes")),
    ("negative length", _patch_length(_bin(2), "C3", 1, -1), InvalidInput,
     "binary body: lengths[C3][1] is -1; lengths must be integers >= 0"),
    ("too many ids", _bin(2, _lengths_at("C4", 1, 4)), InvalidInput,
     ("binary body: lengths[C4][1] is 4; at most 3 ids per feature are allowed; drop or hash the "
      "extra ids")),
    ("dense nan", _bin(2, _dense_at(1, 4, float("nan"))), InvalidInput,
     "binary body: dense[1][4] is nan; dense values must be finite"),
    ("dense inf", _bin(2, _dense_at(0, 12, float("inf"))), InvalidInput,
     "binary body: dense[0][12] is inf; dense values must be finite"),
    ("dense -inf", _bin(2, _dense_at(1, 0, float("-inf"))), InvalidInput,
     "binary body: dense[1][0] is -inf; dense values must be finite"),
    ("negative id", _bin(2, _negative_id), InvalidInput,
     "binary body: values[6] (C3, sample 1): -5 is negative; ids must be integers >= 0"),
    ("over max_body_bytes", b"DLRM" + bytes(100_000), PayloadTooLarge,
     ("body is 100004 bytes; the limit is 100000 bytes; split the instances over several "
      "requests")),
]


@pytest.mark.parametrize("name,body,exc,message", BAD_BINARY, ids=[b[0] for b in BAD_BINARY])
def test_bad_binary_is_rejected_with_the_field_and_rule(name, body, exc, message):
    with pytest.raises(exc) as e:
        parse_body(body, CFG, BINARY_MEDIA_TYPE)
    assert type(e.value) is exc
    assert e.value.message == message


def test_binary_body_as_text_is_rejected_and_media_type_is_checked():
    with pytest.raises(InvalidInput, match=r"^binary body: arrived as text; send the raw bytes "
                                           r"from encode_binary$"):
        parse_body("DLRM", CFG, BINARY_MEDIA_TYPE)
    with pytest.raises(ValueError, match=r"^media_type 'text/plain' must be 'application/json' "
                                         r"or 'application/x-dlrm-columnar'$"):
        parse_body(b"{}", CFG, "text/plain")


def test_encode_binary_rejects_malformed_arrays():
    d, ln, v = np.zeros((2, 13), np.float32), np.ones((26, 2), np.int32), np.arange(52)
    assert len(encode_binary(d, ln, v)) == _TWO
    with pytest.raises(ValueError, match=r"^dense has shape \(2, 12\); it must be \(B, 13\)$"):
        encode_binary(d[:, :12], ln, v)
    with pytest.raises(ValueError, match=r"^lengths has shape \(2, 26\); it must be \(26, B=2\)"):
        encode_binary(d, ln.T, v)
    with pytest.raises(ValueError, match=r"^values has 51 ids but lengths sum to 52; they must"):
        encode_binary(d, ln, v[:51])
    with pytest.raises(ValueError, match=r"^lengths must be in \[0, 2\^31-1\]; got -1..1$"):
        encode_binary(d, np.where(np.arange(2) == 0, ln, -1), v)
    with pytest.raises(ValueError, match=r"^values has dtype float64; it must hold integers$"):
        encode_binary(d, ln, v.astype(np.float64))
    with pytest.raises(ValueError, match=r"^values: 18446744073709551615 is greater than 2\^63-1"):
        encode_binary(d, ln, np.full(52, 2**64 - 1, dtype=np.uint64))


def test_binary_and_json_requests_merge_into_one_forward(tiny_runtime):
    dense, lengths, values = _multi_hot_arrays(3, seed=21)
    json_req = _multi_hot(2, 22)
    bodies = [encode_binary(dense, lengths, values), orjson.dumps(json_req),
              bytearray(example_binary(1, seed=3)), "DLRM", orjson.dumps(json_req),
              example_binary(2, seed=4)]
    ctypes = [BINARY_MEDIA_TYPE, None, "application/x-dlrm-columnar", BINARY_MEDIA_TYPE,
              BINARY_MEDIA_TYPE, "application/x-dlrm-columnar; charset=utf-8"]
    calls, counting = _counting_predict(tiny_runtime)
    outs, info = handle_batch(bodies, ctypes, counting, CFG)
    assert calls == [[3, 2, 1]] and info.instances == 6 and info.requests == 3
    assert [o.status for o in outs] == [200, 200, 200, 400, 400, 415]
    assert orjson.loads(outs[3].body)["message"] == ("binary body: arrived as text; send the "
                                                     "raw bytes from encode_binary")
    assert orjson.loads(outs[4].body)["message"].startswith("binary body: magic is b'{\"in';")
    refs = [parse_body(orjson.dumps(r), CFG) for r in (
        orjson.loads(_columnar_json(dense, lengths, values)), json_req, example_request(1, seed=3))]
    for out, p in zip(outs[:3], refs, strict=True):
        alone = _predict_with(tiny_runtime)(merge_requests([p]))
        got = np.array(orjson.loads(out.body)["predictions"], dtype=np.float32)
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- JSON fast path
# parse_body tries a fast path first (json_body._fast_parse) and falls back to the
# validating parse (json_body.parse_doc) for anything it cannot prove valid. The fast path
# must build bit-identical arrays for what it accepts and accept nothing the validating
# parse refuses; the validating parse is called directly as the reference.

F32_MAX = float(np.finfo(np.float32).max)
BIG_CFG = HandlerConfig(max_instances=512, max_ids_per_feature=3)
# dense cells beside normal floats: ints (up to 2^64-1, which orjson keeps as int),
# negatives, the float32 limits, subnormals, values whose float64 -> float32 rounding is
# a tie or double-rounding case
_DENSE_SPECIALS = [0, 1, -1, 7, -(2**63), 2**63, 2**64 - 1, 2**53 + 1, 9007199791611905,
                   16777217, F32_MAX, -F32_MAX, 3.4e38, -3.4e38, 1e38, -0.0, 0.0, 5e-324,
                   1e-46, 1.401298464324817e-45, 0.1, -123.456, 1e-7]
_ID_SPECIALS = [0, 1, 2, INT64_MAX, INT64_MAX - 1, 2**53 + 1, 2**31, 2**32 - 1]


def _random_request(n: int, seed: int, *, one_hot: bool) -> tuple[list, np.ndarray, list]:
    """(dense: n rows of 13 JSON numbers, lengths (26, n), ids: per feature, a list)."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.integers(-30, 38, size=(n, 13))
    wide = rng.standard_normal((n, 13)) * scale
    kind = rng.integers(0, 4, size=(n, 13))  # 0, 1: float; 2: int; 3: a special value
    dense = [[float(wide[i, j]) if kind[i, j] < 2
              else int(rng.integers(-(2**40), 2**40)) if kind[i, j] == 2
              else _DENSE_SPECIALS[int(rng.integers(len(_DENSE_SPECIALS)))]
              for j in range(13)] for i in range(n)]
    lengths = (np.ones((26, n), dtype=np.int32) if one_hot
               else rng.integers(0, 4, size=(26, n)).astype(np.int32))
    ids = []
    for f in range(26):
        k = int(lengths[f].sum())
        col = rng.integers(0, INT64_MAX, size=k, dtype=np.int64, endpoint=True).tolist()
        for i in range(k):
            if rng.random() < 0.1:
                col[i] = _ID_SPECIALS[int(rng.integers(len(_ID_SPECIALS)))]
        ids.append(col)
    return dense, lengths, ids


def _as_rows(dense: list, lengths: np.ndarray, ids: list) -> bytes:
    n = len(dense)
    ends = np.cumsum(lengths, axis=1)
    return orjson.dumps({"instances": [
        {"dense": dense[b],
         "sparse": {f: ids[fi][int(ends[fi, b] - lengths[fi, b]):int(ends[fi, b])]
                    for fi, f in enumerate(SPARSE_FEATURES)}}
        for b in range(n)]})


def _as_columnar(dense: list, lengths: np.ndarray, ids: list) -> bytes:
    return orjson.dumps({"dense": dense, "sparse": {
        f: {"values": ids[fi], "lengths": lengths[fi].tolist()}
        for fi, f in enumerate(SPARSE_FEATURES)}})


def _assert_identical(a, b) -> None:
    for name in ("dense", "lengths", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert x.tobytes() == y.tobytes(), name  # bit-identical (-0.0 included)
        assert x.flags.c_contiguous and x.flags.writeable and x.flags.aligned, name


@pytest.mark.parametrize("n", [1, 7, 512])
@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("form", ["rows", "columnar"])
def test_fast_path_equals_the_validating_parse(form, one_hot, n):
    encode = _as_rows if form == "rows" else _as_columnar
    for seed in range(12 if n < 512 else 2):
        dense, lengths, ids = _random_request(n, seed * 1000 + n, one_hot=one_hot)
        body = encode(dense, lengths, ids)
        fast = json_body._fast_parse(orjson.loads(body), BIG_CFG)
        assert fast is not None, f"seed {seed}: the fast path refused a valid body"
        slow = json_body.parse_doc(orjson.loads(body), BIG_CFG)
        _assert_identical(fast, slow)
        _assert_identical(parse_body(body, BIG_CFG), slow)
        assert slow.lengths.tolist() == lengths.tolist()
        assert slow.values.tolist() == [v for col in ids for v in col]


@pytest.mark.parametrize("form", ["rows", "columnar"])
def test_fast_path_takes_bodies_without_any_id(form):
    lengths = np.zeros((26, 3), dtype=np.int32)
    body = (_as_rows if form == "rows" else _as_columnar)([[1.5] * 13] * 3, lengths,
                                                          [[] for _ in range(26)])
    fast = json_body._fast_parse(orjson.loads(body), CFG)
    assert fast is not None and fast.values.shape == (0,)
    _assert_identical(fast, json_body.parse_doc(orjson.loads(body), CFG))


def _rows2(f) -> bytes:
    """A valid 2-instance row body (one-hot), changed by ``f``."""
    return _mut(f, example_request(2, seed=3))


def _rows2_multi(f) -> bytes:
    """A valid 2-instance multi-hot row body (ids in C1 of instance 0: 3, so the fast path
    takes its multi-hot branch), changed by ``f``."""
    base = example_request(2, seed=3)
    base["instances"][0]["sparse"]["C1"] = [5, 6, 7]
    base["instances"][1]["sparse"]["C2"] = []
    return _mut(f, base)


def _cols2(f) -> bytes:
    return _mut(f, example_request(2, seed=3, form="columnar"))


def _sp(i: int, feat: str, v):
    return lambda d: d["instances"][i]["sparse"].__setitem__(feat, v)


def _dn(i: int, j: int, v):
    return lambda d: d["instances"][i]["dense"].__setitem__(j, v)


def _col(feat: str, key: str, v):
    return lambda d: d["sparse"][feat].__setitem__(key, v)


FAST_BAD = [
    ("rows: bool in dense", _rows2(_dn(1, 3, True))),
    ("rows: false in dense", _rows2(_dn(0, 0, False))),
    ("rows: string in dense", _rows2(_dn(1, 3, "1.5"))),
    ("rows: null in dense", _rows2(_dn(0, 12, None))),
    ("rows: list in dense", _rows2(_dn(0, 12, [1.0]))),
    ("rows: dense 1e39", _rows2(_dn(1, 2, 1e39))),
    ("rows: dense -1e39", _rows2(_dn(1, 2, -1e39))),
    ("rows: dense just over float32 max", _rows2(_dn(0, 5, 3.4028235e38))),
    ("rows: dense 12 values", _rows2(lambda d: d["instances"][1]["dense"].pop())),
    ("rows: dense 14 values", _rows2(lambda d: d["instances"][0]["dense"].append(1.0))),
    ("rows: dense a 13-char string", _rows2(lambda d: d["instances"][0].__setitem__(
        "dense", "1234567890123"))),
    ("rows: dense an object of 13 keys", _rows2(lambda d: d["instances"][0].__setitem__(
        "dense", {str(k): 1.0 for k in range(13)}))),
    ("rows: dense a number", _rows2(lambda d: d["instances"][0].__setitem__("dense", 1.0))),
    ("rows: bool id", _rows2(_sp(0, "C1", [True]))),
    ("rows: bool id multi-hot", _rows2_multi(_sp(1, "C9", [3, False]))),
    ("rows: float id 1.0", _rows2(_sp(1, "C7", [1.0]))),
    ("rows: float id multi-hot", _rows2_multi(_sp(1, "C7", [3, 2.5]))),
    ("rows: negative id", _rows2(_sp(1, "C7", [-5]))),
    ("rows: negative id multi-hot", _rows2_multi(_sp(1, "C26", [4, -1]))),
    ("rows: id 2^63", _rows2(_sp(0, "C26", [2**63]))),
    ("rows: id 2^64-1 multi-hot", _rows2_multi(_sp(0, "C26", [1, 2**64 - 1]))),
    ("rows: string id", _rows2(_sp(0, "C1", ["7"]))),
    ("rows: one-char string cell", _rows2(_sp(0, "C4", "7"))),
    ("rows: one-key object cell", _rows2(_sp(1, "C4", {"7": 7}))),
    ("rows: empty string cell", _rows2_multi(_sp(1, "C4", ""))),
    ("rows: empty object cell", _rows2_multi(_sp(0, "C5", {}))),
    ("rows: nested list id", _rows2(_sp(0, "C5", [[5]]))),
    ("rows: null id", _rows2_multi(_sp(0, "C5", [1, None]))),
    ("rows: number cell", _rows2(_sp(0, "C2", 7))),
    ("rows: null cell", _rows2_multi(_sp(1, "C2", None))),
    ("rows: missing feature", _rows2(lambda d: d["instances"][1]["sparse"].pop("C7"))),
    ("rows: extra feature", _rows2(_sp(0, "C27", [1]))),
    ("rows: renamed feature", _rows2(lambda d: d["instances"][0].__setitem__("sparse", {
        ("c1" if f == "C1" else f): v for f, v in d["instances"][0]["sparse"].items()}))),
    ("rows: sparse a list", _rows2(lambda d: d["instances"][0].__setitem__(
        "sparse", [[1]] * 26))),
    ("rows: extra key in instance", _rows2(lambda d: d["instances"][0].update(x=1))),
    ("rows: instance without sparse", _rows2(lambda d: d["instances"][1].pop("sparse"))),
    ("rows: instance a 2-item list", _rows2(lambda d: d["instances"].__setitem__(0, [1, 2]))),
    ("rows: extra top-level key", _rows2(lambda d: d.update(foo=1))),
    ("rows: instances an object", b'{"instances": {"a": 1}}'),
    ("rows: empty instances", b'{"instances": []}'),
    ("rows: too many instances", orjson.dumps(example_request(5))),
    ("rows: too many ids", _rows2_multi(_sp(1, "C3", [1, 2, 3, 4]))),
    ("rows: too many ids one-hot otherwise", _rows2(_sp(1, "C3", [1, 2, 3, 4]))),
    ("columnar: bool in dense", _cols2(lambda d: d["dense"][0].__setitem__(0, True))),
    ("columnar: dense 1e39", _cols2(lambda d: d["dense"][1].__setitem__(12, 1e39))),
    ("columnar: dense row length", _cols2(lambda d: d["dense"][0].append(1))),
    ("columnar: dense empty", _cols2(lambda d: d.update(dense=[]))),
    ("columnar: dense an object", _cols2(lambda d: d.update(dense={"a": [1.0] * 13}))),
    ("columnar: lengths bool", _cols2(_col("C3", "lengths", [True, 1]))),
    ("columnar: lengths 1.0", _cols2(_col("C3", "lengths", [1.0, 1]))),
    ("columnar: lengths negative", _cols2(_col("C3", "lengths", [-1, 3]))),
    ("columnar: lengths over the cap", _cols2(lambda d: d["sparse"]["C4"].update(
        values=[1, 2, 3, 4, 5], lengths=[1, 4]))),
    ("columnar: lengths beyond int32", _cols2(_col("C4", "lengths", [2**40, 1]))),
    ("columnar: lengths count", _cols2(_col("C3", "lengths", [1]))),
    ("columnar: lengths vs values", _cols2(_col("C3", "lengths", [1, 2]))),
    ("columnar: lengths a string", _cols2(_col("C3", "lengths", "11"))),
    ("columnar: values an object", _cols2(_col("C3", "values", {"1": 1, "2": 2}))),
    ("columnar: values an empty string", _cols2(lambda d: d["sparse"]["C3"].update(
        values="", lengths=[0, 0]))),
    ("columnar: values an empty object", _cols2(lambda d: d["sparse"]["C3"].update(
        values={}, lengths=[0, 0]))),
    ("columnar: lengths counts that add up", _cols2(lambda d: d["sparse"].update(
        C3={"values": [1, 2], "lengths": [2]}, C4={"values": [], "lengths": [0, 0, 0]}))),
    ("columnar: values bool", _cols2(_col("C3", "values", [1, True]))),
    ("columnar: values 1.0", _cols2(_col("C3", "values", [1.0, 2]))),
    ("columnar: values negative", _cols2(_col("C3", "values", [1, -2]))),
    ("columnar: values 2^63", _cols2(_col("C3", "values", [2**63, 2]))),
    ("columnar: values string", _cols2(_col("C3", "values", [1, "2"]))),
    ("columnar: missing lengths", _cols2(lambda d: d["sparse"]["C3"].pop("lengths"))),
    ("columnar: extra key in column", _cols2(_col("C3", "x", 1))),
    ("columnar: column a list", _cols2(lambda d: d["sparse"].__setitem__("C3", [1, 2]))),
    ("columnar: missing feature", _cols2(lambda d: d["sparse"].pop("C26"))),
    ("columnar: extra feature", _cols2(lambda d: d["sparse"].__setitem__(
        "C27", {"values": [], "lengths": [0, 0]}))),
    ("columnar: sparse a list", _cols2(lambda d: d.update(sparse=[1]))),
    ("columnar: too many rows", orjson.dumps(example_request(5, form="columnar"))),
    ("columnar: extra top-level key", _cols2(lambda d: d.update(instances=[]))),
    ("top-level array", b"[1, 2]"),
    ("top-level object of one other key", b'{"dense": []}'),
]




def _big(f, form: str = "rows") -> bytes:
    """A valid 8-instance body (more ids, dense values and lengths than the fast path
    checks with Python's min/max: its numpy branch), changed by ``f``; for BIG_CFG."""
    return _mut(f, example_request(8, seed=4, form=form))


def _big_multi(f) -> bytes:
    base = example_request(8, seed=4)
    base["instances"][3]["sparse"]["C1"] = [5, 6, 7]
    return _mut(f, base)


# checked against BIG_CFG (512 instances, 3 ids per feature)
FAST_BAD_BIG = [
    ("big rows: negative id", _big(_sp(7, "C26", [-3]))),
    ("big rows: negative id multi-hot", _big_multi(_sp(5, "C2", [4, -3]))),
    ("big rows: id 2^63", _big(_sp(7, "C26", [2**63]))),
    ("big rows: bool id", _big(_sp(6, "C20", [False]))),
    ("big rows: dense 1e39", _big(_dn(7, 12, 1e39))),
    ("big rows: dense -3.5e38", _big(_dn(0, 0, -3.5e38))),
    ("big rows: bool in dense", _big(_dn(3, 3, True))),
    ("big rows: too many ids", _big_multi(_sp(7, "C26", [1, 2, 3, 4]))),
    ("big columnar: lengths negative", _big(_col("C9", "lengths", [1] * 7 + [-1]), "columnar")),
    ("big columnar: lengths over the cap", _big(lambda d: d["sparse"]["C9"].update(
        lengths=[0] * 7 + [8], values=list(range(8))), "columnar")),
    ("big columnar: negative id", _big(_col("C9", "values", [1] * 7 + [-1]), "columnar")),
    ("big columnar: dense 1e39", _big(lambda d: d["dense"][7].__setitem__(1, 1e39),
                                      "columnar")),
]


@pytest.mark.parametrize("name,body,cfg",
                         [(*b, CFG) for b in FAST_BAD] + [(*b, BIG_CFG) for b in FAST_BAD_BIG],
                         ids=[b[0] for b in FAST_BAD + FAST_BAD_BIG])
def test_fast_path_refuses_and_errors_are_the_validating_parse_s(name, body, cfg):
    doc = orjson.loads(body)
    assert json_body._fast_parse(doc, cfg) is None
    with pytest.raises(ServeError) as want:
        json_body.parse_doc(orjson.loads(body), cfg)
    with pytest.raises(ServeError) as got:
        parse_body(body, cfg)
    assert type(got.value) is type(want.value) and type(want.value) in (InvalidInput,
                                                                       PayloadTooLarge)
    assert got.value.message == want.value.message


_ODD_VALUES = [True, False, None, "", "7", {}, {"a": 1}, [], [1], [[1]], [1, 2], [1, 2, 3, 4],
               1.0, 1.5, -1, 0, 1, 2**63, INT64_MAX, 2**64 - 1, -(2**63), 1e39, 3.4028235e38,
               [True], [1.0], ["1"], [None], [-1], {"values": [], "lengths": []}]


def _outcome(parse, body: bytes) -> tuple:
    try:
        p = parse(body)
    except ServeError as e:
        return type(e).__name__, e.message
    return tuple((a.dtype.str, a.shape, a.tobytes()) for a in (p.dense, p.lengths, p.values))


def test_randomly_broken_bodies_get_the_validating_parse_s_result_or_error():
    """Seeded fuzz: replace, drop or add one or two values anywhere in a valid body."""
    rng = np.random.default_rng(2024)
    accepted = 0
    for case in range(600):
        form = ("rows", "columnar")[case % 2]
        doc = example_request(1 + case % 3, seed=case, form=form,
                              max_id=(4, 2**31, INT64_MAX)[case % 3])
        for _ in range(int(rng.integers(0, 3))):  # 0: the valid body itself
            nodes, todo = [], [doc]
            while todo:  # every (container, key) pair of the tree
                c = todo.pop()
                for k in (list(c) if isinstance(c, dict) else range(len(c))):
                    nodes.append((c, k))
                    if isinstance(c[k], (dict, list)):
                        todo.append(c[k])
            if not nodes:
                break
            c, k = nodes[int(rng.integers(len(nodes)))]
            op = rng.random()
            if op < 0.7:
                c[k] = copy.deepcopy(_ODD_VALUES[int(rng.integers(len(_ODD_VALUES)))])
            elif op < 0.85:
                c.pop(k)
            elif isinstance(c, dict):
                c["x"] = 1
            else:
                c.append(1)
        body = orjson.dumps(doc)
        got = _outcome(lambda b: parse_body(b, CFG), body)
        assert got == _outcome(lambda b: json_body.parse_doc(orjson.loads(b), CFG), body), body
        accepted += isinstance(got[0], tuple)
    assert 150 < accepted < 450  # both outcomes well represented


# ----------------------------------------------------------------------------- model schemas
# The decoders check the served model's schema (serve.schema.ModelSchema), not Criteo's.
# CUSTOM: N=3 dense; user_id and item_id one id each, history up to 20 ids; item_id and
# history read one table.

CUSTOM = ModelSchema(
    dense=3,
    tables=(TableSpec("t_user", rows=1000, dim=8), TableSpec("t_item", rows=5000, dim=8)),
    features=(FeatureSpec("user_id", "t_user", 1), FeatureSpec("item_id", "t_item", 1),
              FeatureSpec("history", "t_item", 20)))
CUSTOM_NAMES = "user_id, item_id, history"
WIDE_CFG = HandlerConfig(max_instances=512, max_ids_per_feature=64)  # the model's caps bind
NARROW_CFG = HandlerConfig(max_instances=512, max_ids_per_feature=3)  # the handler's bind
# 2 instances, written by hand; sparse keys deliberately not in the schema's order
CUSTOM_ROWS = {"instances": [
    {"dense": [1.5, 2, -3.25], "sparse": {"history": [1, 2, 3], "user_id": [7], "item_id": [42]}},
    {"dense": [0, 0.25, 1e3], "sparse": {"item_id": [43], "history": [], "user_id": [INT64_MAX]}},
]}
CUSTOM_COLUMNAR = {"dense": [[1.5, 2, -3.25], [0, 0.25, 1e3]], "sparse": {
    "history": {"values": [1, 2, 3], "lengths": [3, 0]},
    "user_id": {"values": [7, INT64_MAX], "lengths": [1, 1]},
    "item_id": {"values": [42, 43], "lengths": [1, 1]}}}
CUSTOM_DENSE = np.array([[1.5, 2, -3.25], [0, 0.25, 1e3]], dtype=np.float32)
CUSTOM_LENGTHS = np.array([[1, 1], [1, 1], [3, 0]], dtype=np.int32)
CUSTOM_VALUES = np.array([7, INT64_MAX, 42, 43, 1, 2, 3], dtype=np.int64)


def _check_custom(p) -> None:
    assert p.dense.dtype == np.float32 and p.dense.shape == (2, 3)
    assert p.lengths.dtype == np.int32 and p.lengths.shape == (3, 2)
    assert p.values.dtype == np.int64 and p.values.shape == (7,)
    np.testing.assert_array_equal(p.dense, CUSTOM_DENSE)
    np.testing.assert_array_equal(p.lengths, CUSTOM_LENGTHS)
    np.testing.assert_array_equal(p.values, CUSTOM_VALUES)  # feature-major, schema order


@pytest.mark.parametrize("form", ["rows", "columnar", "binary"])
def test_custom_schema_bodies_parse_feature_major_in_schema_order(form):
    if form == "binary":
        body = encode_binary(CUSTOM_DENSE, CUSTOM_LENGTHS, CUSTOM_VALUES, schema=CUSTOM)
        assert len(body) == 20 + 4 * 2 * 3 + 4 * 3 * 2 + 8 * 7
        p = parse_body(body, WIDE_CFG, BINARY_MEDIA_TYPE, schema=CUSTOM)
    else:
        doc = CUSTOM_ROWS if form == "rows" else CUSTOM_COLUMNAR
        body = orjson.dumps(doc)
        assert json_body._fast_parse(orjson.loads(body), WIDE_CFG,
                                    spec_of(CUSTOM)) is not None
        p = parse_body(body, WIDE_CFG, schema=CUSTOM)
        _assert_identical(p, json_body.parse_doc(orjson.loads(body), WIDE_CFG,
                                                 spec_of(CUSTOM)))
    _check_custom(p)


def _custom(f, form: str = "rows") -> bytes:
    return _mut(f, CUSTOM_ROWS if form == "rows" else CUSTOM_COLUMNAR)


def _custom_bin(dense=CUSTOM_DENSE, lengths=CUSTOM_LENGTHS, schema=CUSTOM) -> bytes:
    lengths = np.asarray(lengths, dtype=np.int32)
    rng = np.random.default_rng(5)
    return encode_binary(dense, lengths, rng.integers(0, 100, size=int(lengths.sum())),
                         schema=schema)


def _csp(i: int, feat: str, v):
    return lambda d: d["instances"][i]["sparse"].__setitem__(feat, v)


_EXPECTED = rf"every instance needs exactly the sparse features {CUSTOM_NAMES} \(an empty list \[\] for no ids\)$"

BAD_CUSTOM = [
    ("rows: unknown feature", WIDE_CFG, _custom(_csp(1, "C1", [1])),
     rf"^instances\[1\].sparse: unknown features C1; {_EXPECTED}"),
    ("rows: missing feature", WIDE_CFG, _custom(lambda d: d["instances"][0]["sparse"].pop("item_id")),
     rf"^instances\[0\].sparse: missing features item_id; {_EXPECTED}"),
    ("rows: renamed feature", WIDE_CFG, _custom(lambda d: d["instances"][1]["sparse"].__setitem__(
        "user", d["instances"][1]["sparse"].pop("user_id"))),
     rf"^instances\[1\].sparse: missing features user_id; unknown features user; {_EXPECTED}"),
    ("rows: sparse not an object", WIDE_CFG, _custom(lambda d: d["instances"][0].__setitem__(
        "sparse", [])),
     (r'^instances\[0\].sparse: is a JSON array; expected an object \{"user_id": \[ids\], '
      r'..., "history": \[ids\]\}$')),
    ("rows: 2 ids in a one-id feature", WIDE_CFG, _custom(_csp(1, "user_id", [1, 2])),
     (r"^instances\[1\].sparse.user_id: has 2 ids; the model accepts at most 1 id in user_id "
      r"\(its max_ids\); drop or hash the extra ids$")),
    ("rows: 21 ids in history", WIDE_CFG, _custom(_csp(0, "history", list(range(21)))),
     (r"^instances\[0\].sparse.history: has 21 ids; the model accepts at most 20 ids in "
      r"history \(its max_ids\); drop or hash the extra ids$")),
    ("rows: the handler's cap is tighter", NARROW_CFG, _custom(_csp(0, "history", [1, 2, 3, 4])),
     (r"^instances\[0\].sparse.history: has 4 ids; at most 3 ids per feature are allowed; "
      r"drop or hash the extra ids$")),
    ("rows: the model's cap is tighter", NARROW_CFG, _custom(_csp(0, "item_id", [1, 2])),
     r"^instances\[0\].sparse.item_id: has 2 ids; the model accepts at most 1 id in item_id "),
    ("rows: 13 dense values", WIDE_CFG, _custom(lambda d: d["instances"][1].__setitem__(
        "dense", [1.0] * 13)),
     r"^instances\[1\].dense: has 13 values; it must have exactly 3 \(the model's dense features\)$"),
    ("rows: dense not an array", WIDE_CFG, _custom(lambda d: d["instances"][0].__setitem__(
        "dense", 1)),
     (r"^instances\[0\].dense: is a JSON number; expected an array of 3 numbers \(the model's "
      r"dense features\)$")),
    ("columnar: unknown feature", WIDE_CFG, _custom(lambda d: d["sparse"].__setitem__(
        "C1", {"values": [], "lengths": [0, 0]}), "columnar"),
     rf"^sparse: unknown features C1; {_EXPECTED}"),
    ("columnar: missing feature", WIDE_CFG, _custom(lambda d: d["sparse"].pop("history"),
                                                    "columnar"),
     rf"^sparse: missing features history; {_EXPECTED}"),
    ("columnar: 2 ids in a one-id feature", WIDE_CFG, _custom(lambda d: d["sparse"].__setitem__(
        "user_id", {"values": [1, 2, 3], "lengths": [1, 2]}), "columnar"),
     (r"^sparse.user_id.lengths\[1\]: has 2 ids; the model accepts at most 1 id in user_id "
      r"\(its max_ids\); drop or hash the extra ids$")),
    ("columnar: 21 ids in history", WIDE_CFG, _custom(lambda d: d["sparse"].__setitem__(
        "history", {"values": list(range(21)), "lengths": [0, 21]}), "columnar"),
     (r"^sparse.history.lengths\[1\]: has 21 ids; the model accepts at most 20 ids in history "
      r"\(its max_ids\); drop or hash the extra ids$")),
    ("columnar: the handler's cap is tighter", NARROW_CFG, _custom(lambda d: d["sparse"].__setitem__(
        "history", {"values": list(range(5)), "lengths": [1, 4]}), "columnar"),
     r"^sparse.history.lengths\[1\]: has 4 ids; at most 3 ids per feature are allowed; "),
    ("columnar: 4 dense values", WIDE_CFG, _custom(lambda d: d["dense"][1].append(1.0),
                                                   "columnar"),
     r"^dense\[1\]: has 4 values; it must have exactly 3 \(the model's dense features\)$"),
    ("built-in rows body", WIDE_CFG, orjson.dumps(example_request(1, seed=1)),
     (r"^instances\[0\].sparse: missing features user_id, item_id, history; unknown features "
      rf"C1, C10, .*, C9; {_EXPECTED}")),
    ("built-in columnar body", WIDE_CFG, orjson.dumps(example_request(2, seed=1, form="columnar")),
     (r"^sparse: missing features user_id, item_id, history; unknown features C1, C10, .*, C9; "
      rf"{_EXPECTED}")),
]


@pytest.mark.parametrize("name,cfg,body,match", BAD_CUSTOM, ids=[b[0] for b in BAD_CUSTOM])
def test_custom_schema_errors_name_the_feature_and_the_rule(name, cfg, body, match):
    spec = spec_of(CUSTOM)
    assert json_body._fast_parse(orjson.loads(body), cfg, spec) is None
    with pytest.raises(InvalidInput, match=match):
        parse_body(body, cfg, schema=CUSTOM)
    outs, _ = handle_batch([body], [JSON_MEDIA_TYPE], _no_forward, cfg, schema=CUSTOM)
    assert outs[0].status == 400  # the handler's route: a 400 JSON body naming the same
    got = orjson.loads(outs[0].body)
    assert got["type"] == "InvalidInput" and re.search(match, got["message"])


def _no_forward(m):
    raise AssertionError("no forward for a refused body")


BAD_CUSTOM_BINARY = [
    ("built-in body", example_binary(2, seed=1),
     f"binary body: F is 26; it must be 3 ({CUSTOM_NAMES})"),
    ("N = 4", _custom_bin(np.zeros((2, 4)), schema=ModelSchema(4, CUSTOM.tables, CUSTOM.features)),
     "binary body: N is 4; it must be 3 (the model's dense features)"),
    ("2 ids in a one-id feature", _custom_bin(lengths=[[1, 2], [1, 1], [0, 0]]),
     ("binary body: lengths[user_id][1] is 2; the model accepts at most 1 id in user_id (its "
      "max_ids); drop or hash the extra ids")),
    ("21 ids in history", _custom_bin(lengths=[[1, 1], [1, 1], [21, 0]]),
     ("binary body: lengths[history][0] is 21; the model accepts at most 20 ids in history "
      "(its max_ids); drop or hash the extra ids")),
]


@pytest.mark.parametrize("name,body,message", BAD_CUSTOM_BINARY,
                         ids=[b[0] for b in BAD_CUSTOM_BINARY])
def test_custom_schema_binary_errors(name, body, message):
    with pytest.raises(InvalidInput) as e:
        parse_body(body, WIDE_CFG, BINARY_MEDIA_TYPE, schema=CUSTOM)
    assert e.value.message == message


def test_custom_schema_binary_caps_under_a_tighter_handler_cap():
    body = _custom_bin(lengths=[[1, 1], [1, 1], [2, 4]])
    with pytest.raises(InvalidInput) as e:
        parse_body(body, NARROW_CFG, BINARY_MEDIA_TYPE, schema=CUSTOM)
    assert e.value.message == ("binary body: lengths[history][1] is 4; at most 3 ids per "
                               "feature are allowed; drop or hash the extra ids")
    ok = parse_body(_custom_bin(lengths=[[1, 1], [1, 1], [20, 3]]), WIDE_CFG, BINARY_MEDIA_TYPE,
                    schema=CUSTOM)
    assert ok.lengths.tolist() == [[1, 1], [1, 1], [20, 3]]


@pytest.mark.parametrize("n", [1, 7, 100])  # 100: 300 cells, the numpy branches
@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("form", ["rows", "columnar"])
def test_custom_schema_fast_path_equals_the_validating_parse(form, multi_hot, n):
    spec = spec_of(CUSTOM)
    for seed in range(8):
        doc = example_request(n, seed=seed, form=form, schema=CUSTOM, multi_hot=multi_hot,
                              max_id=INT64_MAX)
        body = orjson.dumps(doc)
        fast = json_body._fast_parse(orjson.loads(body), WIDE_CFG, spec)
        assert fast is not None, f"seed {seed}: the fast path refused a valid body"
        slow = json_body.parse_doc(orjson.loads(body), WIDE_CFG, spec)
        _assert_identical(fast, slow)
        _assert_identical(parse_body(body, WIDE_CFG, schema=CUSTOM), slow)
        assert slow.dense.shape == (n, 3) and slow.lengths.shape == (3, n)
        if multi_hot:
            assert slow.lengths[:2].max() <= 1 and slow.lengths[2].max() <= 20
        binary = parse_body(example_binary(n, seed=seed, schema=CUSTOM, multi_hot=multi_hot,
                                           max_id=INT64_MAX), WIDE_CFG, BINARY_MEDIA_TYPE,
                            schema=CUSTOM)
        _assert_same(binary, slow)


def _custom_many(n: int, f) -> bytes:
    """A valid n-instance one-hot custom body (history: 2 ids each), changed by ``f``."""
    doc = example_request(n, seed=9, schema=CUSTOM)
    for inst in doc["instances"]:
        inst["sparse"]["history"] = [5, 6]
    return _mut(f, doc)


def _custom_many_columnar(n: int, f) -> bytes:
    doc = example_request(n, seed=9, form="columnar", schema=CUSTOM)
    doc["sparse"]["history"] = {"values": list(range(2 * n)), "lengths": [2] * n}
    return _mut(f, doc)


# caps between the smallest and the largest: the fast path's per-feature check, with
# Python's reductions (few cells) and numpy's (many)
def _custom_fast_bad(n: int) -> list[tuple[str, bytes]]:
    item = {"values": list(range(n + 1)), "lengths": [1] * (n - 1) + [2]}
    history = {"values": list(range(21 + 2 * (n - 1))), "lengths": [21] + [2] * (n - 1)}
    return [
        (f"rows, {n} instances: 2 ids in user_id", _custom_many(n, _csp(n - 1, "user_id", [1, 2]))),
        (f"rows, {n} instances: 21 ids in history",
         _custom_many(n, _csp(0, "history", list(range(21))))),
        (f"columnar, {n} instances: 2 ids in item_id",
         _custom_many_columnar(n, lambda d: d["sparse"].__setitem__("item_id", item))),
        (f"columnar, {n} instances: 21 ids in history",
         _custom_many_columnar(n, lambda d: d["sparse"].__setitem__("history", history))),
    ]


CUSTOM_FAST_BAD = _custom_fast_bad(1) + _custom_fast_bad(30)


@pytest.mark.parametrize("name,body", CUSTOM_FAST_BAD, ids=[b[0] for b in CUSTOM_FAST_BAD])
def test_custom_schema_fast_path_refuses_what_exceeds_a_feature_s_cap(name, body):
    spec = spec_of(CUSTOM)
    assert json_body._fast_parse(orjson.loads(body), WIDE_CFG, spec) is None
    with pytest.raises(InvalidInput, match=r"the model accepts at most (1 id|20 ids) in "):
        parse_body(body, WIDE_CFG, schema=CUSTOM)


def test_custom_schema_in_a_batch_one_forward_and_a_built_in_body_gets_400():
    seen: list = []

    def predict(m):
        seen.append((m.dense.shape, m.lengths.shape, m.sizes))
        return np.full(m.dense.shape[0], 0.25, dtype=np.float32)

    bodies = [orjson.dumps(CUSTOM_ROWS), orjson.dumps(example_request(1, seed=2)),
              example_binary(3, seed=4, schema=CUSTOM, multi_hot=True), example_binary(1)]
    ctypes = [None, None, BINARY_MEDIA_TYPE, BINARY_MEDIA_TYPE]
    outs, _ = handle_batch(bodies, ctypes, predict, WIDE_CFG, schema=CUSTOM)
    assert [o.status for o in outs] == [200, 400, 200, 400]
    assert seen == [((5, 3), (3, 5), [2, 3])]
    assert orjson.loads(outs[0].body) == {"predictions": [0.25, 0.25]}
    assert orjson.loads(outs[1].body)["message"].startswith(
        "instances[0].sparse: missing features user_id, item_id, history; unknown features C1")
    assert orjson.loads(outs[3].body)["message"] == (
        f"binary body: F is 26; it must be 3 ({CUSTOM_NAMES})")


def test_the_default_schema_is_the_built_in_model_s():
    assert get_profile("small").schema() == request.DEFAULT_SCHEMA
    body = orjson.dumps(example_request(2, seed=6, form="columnar"))
    _assert_identical(parse_body(body, CFG, schema=request.DEFAULT_SCHEMA), parse_body(body, CFG))
    # other tables (rows, dims, dtype), the same requests: one set of decoder helpers
    tiny = get_profile("tiny").schema("int4")
    assert tiny != request.DEFAULT_SCHEMA and not tiny.request_differences(request.DEFAULT_SCHEMA)
    assert spec_of(None) is spec_of(tiny)
    with pytest.raises(TypeError, match=r"^schema must be a serve.schema.ModelSchema or None"):
        parse_body(body, CFG, schema={"dense": 13})  # type: ignore[arg-type]


def test_feature_names_in_messages_are_listed_in_order():
    assert api_spec._names_text(SPARSE_FEATURES) == "C1..C26"
    assert api_spec._names_text(("f1", "f2", "f3")) == "f1..f3"
    assert api_spec._names_text(("f1", "f3", "f2")) == "f1, f3, f2"
    assert api_spec._names_text(("a1", "a2")) == "a1, a2"
    assert api_spec._names_text(("user_id", "item_id", "history")) == CUSTOM_NAMES


ONE_FEATURE = ModelSchema(dense=0, tables=(TableSpec("t", rows=10, dim=4),),
                          features=(FeatureSpec("q", "t", 4),))


@pytest.mark.parametrize("multi_hot", [False, True], ids=["one-hot", "multi-hot"])
@pytest.mark.parametrize("n", [1, 3, 80])
def test_one_feature_and_no_dense_features(multi_hot, n):
    """F = 1 (no tuple from a one-key itemgetter) and N = 0 (empty dense rows)."""
    spec = spec_of(ONE_FEATURE)
    for form in ("rows", "columnar"):
        body = orjson.dumps(example_request(n, seed=n, form=form, schema=ONE_FEATURE,
                                            multi_hot=multi_hot))
        fast = json_body._fast_parse(orjson.loads(body), WIDE_CFG, spec)
        assert fast is not None
        slow = json_body.parse_doc(orjson.loads(body), WIDE_CFG, spec)
        _assert_identical(fast, slow)
        assert slow.dense.shape == (n, 0) and slow.lengths.shape == (1, n)
        binary = parse_body(example_binary(n, seed=n, schema=ONE_FEATURE, multi_hot=multi_hot),
                            WIDE_CFG, BINARY_MEDIA_TYPE, schema=ONE_FEATURE)
        _assert_same(binary, slow)
    bad = orjson.dumps({"instances": [{"dense": [], "sparse": {"q": [1, 2, 3, 4, 5]}}]})
    with pytest.raises(InvalidInput, match=r"^instances\[0\].sparse.q: has 5 ids; the model "
                                           r"accepts at most 4 ids in q \(its max_ids\)"):
        parse_body(bad, WIDE_CFG, schema=ONE_FEATURE)
    with pytest.raises(InvalidInput, match=r"^instances\[0\].sparse: is a JSON array; expected "
                                           r'an object \{"q": \[ids\]\}$'):
        parse_body(b'{"instances": [{"dense": [], "sparse": []}]}', WIDE_CFG, schema=ONE_FEATURE)


#: The names the former ``serve.api.protocol`` facade exported: each keeps one home.
PROTOCOL_NAMES = [
    "BINARY_MEDIA_TYPE", "BINARY_VERSION", "DEFAULT_SCHEMA", "INT64_MAX", "JSON_MEDIA_TYPE",
    "ArmRun", "DeltaWiring", "HandlerConfig", "MergedBatch", "Outcome", "ParsedRequest", "RolloutWiring", "Split", "cache_on_cpu_from_env",
    "check_content_type", "check_route_key", "default_num_threads", "encode_binary",
    "encode_error", "encode_predictions", "example_binary", "example_request", "handle_batch",
    "merge_requests", "parse_body"]


def test_the_protocol_names_each_live_in_one_module():
    """What the deleted ``serve.api.protocol`` facade re-exported is importable from
    exactly one module's ``__all__`` (the codec in ``serve.api``, the arms in
    ``serve.worker.arms``), which defines it: one definition, no copies, no re-exports."""
    import importlib
    import pkgutil

    import serve.api
    from serve.worker import arms

    assert importlib.util.find_spec("serve.api.protocol") is None
    modules = [importlib.import_module(f"serve.api.{m.name}")
               for m in pkgutil.iter_modules(serve.api.__path__)] + [arms]
    for name in PROTOCOL_NAMES:
        holders = [m for m in modules if name in getattr(m, "__all__", ())]
        assert len(holders) == 1, (name, holders)
        obj = getattr(holders[0], name)
        if callable(obj):
            assert obj.__module__ == holders[0].__name__, name
