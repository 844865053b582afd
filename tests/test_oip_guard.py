"""The Open Inference Protocol's bounds (serve.sidecar.http.oip_guard) and its dimension
caps (serve.api.oip, review N6): each refuses at once with the status and message pinned,
and gives back what it held. In process; tests/test_oip_flood.py floods the real process."""
from __future__ import annotations

import asyncio
import threading
import time
from functools import partial

import httpx
import numpy as np
import orjson
import pytest
from starlette.requests import ClientDisconnect

from serve.api.config import HandlerConfig
from serve.api.oip import dimension_cap, encode_infer_request, oip_inputs, parse_infer
from serve.api.spec import spec_of
from serve.errors import (
    InvalidInput,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    UpstreamUnavailable,
)
from serve.sidecar.http.oip_guard import Budget, ParseSlots, ReadyCache, read_body
from serve.sidecar.http.oip_options import OipOptions
from serve.sidecar.http.oip_server import create_oip_app
from tests.test_oip import _FakeUpstreams, _reference

HUGE = 4611686018427387904  # 2**62: np.zeros((0, HUGE)) raised "array is too big" (500)


async def _chunks(*parts: bytes, stall_s: float = 0.0):
    for p in parts:
        yield p
    if stall_s:
        await asyncio.sleep(stall_s)


# --------------------------------------------------------------------------- budget


def test_a_budget_refuses_past_its_capacity_and_gives_back_on_exit():
    b = Budget(10, "bytes of bodies in flight")
    with b.hold(6):
        with pytest.raises(Overloaded, match=r"^this server holds 6 of its 10 bytes of bodies "
                                             r"in flight and this request needs 5 more; retry"):
            b.take(5)
        assert b.in_use == 6
    assert b.in_use == 0
    with pytest.raises(RuntimeError), b.hold(4) as held:
        held.take(3)
        raise RuntimeError("the request failed")
    assert b.in_use == 0 and b.peak == 7
    assert Overloaded("x").status == 429


def test_an_announced_body_past_the_budget_is_refused_before_a_byte_is_read():
    b = Budget(100, "bytes of bodies in flight")
    read: list[bytes] = []

    async def stream():
        read.append(b"x")
        yield b"x" * 101

    async def go() -> None:
        with b.hold() as held:
            await read_body(stream(), "101", held=held, max_bytes=1000, deadline_s=5)
    with pytest.raises(Overloaded):
        asyncio.run(go())
    assert read == [] and b.in_use == 0


def test_a_chunked_body_takes_the_budget_chunk_by_chunk():
    b = Budget(10, "bytes of bodies in flight")

    async def go() -> bytearray:
        with b.hold() as held:
            out = await read_body(_chunks(b"abc", b"defg"), None, held=held, max_bytes=100,
                                  deadline_s=5)
            assert held.amount == 7
            return out
    assert asyncio.run(go()) == b"abcdefg" and b.in_use == 0

    async def over() -> None:
        with b.hold() as held:
            await read_body(_chunks(b"abcdef", b"ghijkl"), None, held=held, max_bytes=100,
                            deadline_s=5)
    with pytest.raises(Overloaded):
        asyncio.run(over())
    assert b.in_use == 0


def test_a_stalled_body_answers_408_at_the_deadline_and_gives_its_bytes_back():
    b = Budget(1000, "bytes of bodies in flight")

    async def go() -> None:
        with b.hold() as held:
            await read_body(_chunks(b"x" * 10, stall_s=30), "999", held=held, max_bytes=1000,
                            deadline_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"^body: 10 of 999 bytes arrived in 0.2 s, the "
                                             r"deadline for a whole body; send it at once"):
        asyncio.run(go())
    assert time.monotonic() - t0 < 2 and b.in_use == 0
    assert RequestTimeout("x").status == 408


@pytest.mark.parametrize(("header", "error", "message"), [
    ("12x", InvalidInput, "header Content-Length: '12x' is not a number of bytes"),
    ("1001", PayloadTooLarge, "body: 1001 bytes is over the 1000-byte limit"),
    (None, PayloadTooLarge, "body: 1200 bytes is over the 1000-byte limit"),
])
def test_body_length_errors(header, error, message):
    b = Budget(10_000, "bytes")

    async def go() -> None:
        with b.hold() as held:
            await read_body(_chunks(b"x" * 600, b"y" * 600), header, held=held,
                            max_bytes=1000, deadline_s=5)
    with pytest.raises(error, match="^" + message):
        asyncio.run(go())
    assert b.in_use == 0


def test_a_client_that_goes_away_mid_body_is_a_400_not_a_500():
    b = Budget(1000, "bytes")

    async def gone():
        yield b"x" * 10
        raise ClientDisconnect()

    async def go() -> None:
        with b.hold() as held:
            await read_body(gone(), "500", held=held, max_bytes=1000, deadline_s=5)
    with pytest.raises(InvalidInput, match=r"^body: the client closed the connection after "
                                           r"10 bytes"):
        asyncio.run(go())
    assert b.in_use == 0


# --------------------------------------------------------------------------- parses


def test_parse_slots_run_one_at_a_time_and_refuse_past_the_wait():
    slots = ParseSlots(1, wait_s=0.2)
    release = threading.Event()
    seen: list[int] = []

    def slow() -> int:
        release.wait(10)
        return 1

    async def go() -> None:
        first = asyncio.create_task(slots.run(slow))
        await asyncio.sleep(0.05)
        assert slots.busy == 1
        with pytest.raises(Overloaded, match=r"^all 1 parse slots stayed busy for 0.2 s"):
            await slots.run(lambda: 2)
        release.set()
        seen.append(await first)
        seen.append(await slots.run(lambda: 3))
    asyncio.run(go())
    assert seen == [1, 3] and slots.busy == 0


def test_parses_in_a_worker_process_return_arrays_and_raise_the_parser_s_errors():
    """Production parses in worker processes (off the event loop's GIL): the request
    and the parser's InvalidInput cross the process boundary unchanged."""
    ref = _reference(3)
    body, _ = encode_infer_request(oip_inputs(ref.dense, ref.lengths, ref.values))
    slots = ParseSlots(1, wait_s=30, processes=True)

    async def go():
        ok = await slots.run(partial(parse_infer, bytearray(body)))
        with pytest.raises(InvalidInput, match=r"^body: is not valid JSON"):
            await slots.run(partial(parse_infer, b"{"))
        return ok
    try:
        slots.warm_up()
        got = asyncio.run(go())
    finally:
        slots.close()
    np.testing.assert_array_equal(got.parsed.values, ref.values)
    np.testing.assert_array_equal(got.parsed.dense, ref.dense)


# --------------------------------------------------------------------------- readiness


def test_the_ready_cache_fetches_once_per_ttl_and_caches_errors_too():
    now = [100.0]
    answers: list[object] = [{"model_version": "v1"}, UpstreamUnavailable("not ready"),
                             {"model_version": "v2"}]

    async def fetch() -> dict:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[return-value]

    cache = ReadyCache(fetch, ttl_s=1.0, clock=lambda: now[0])

    async def go() -> None:
        assert [await cache.get() for _ in range(100)][-1] == {"model_version": "v1"}
        assert cache.fetches == 1
        now[0] += 1.0
        for _ in range(50):
            with pytest.raises(UpstreamUnavailable, match="not ready"):
                await cache.get()
        assert cache.fetches == 2 and cache.last_good == {"model_version": "v1"}
        now[0] += 0.999
        with pytest.raises(UpstreamUnavailable):
            await cache.get()
        now[0] += 0.001
        assert await cache.get() == {"model_version": "v2"} and cache.fetches == 3
    asyncio.run(go())


def test_100_ready_probes_make_one_readyz_call_per_second():
    """The review's N1 unit test: GET /v2/health/ready x 100 in one second of the app's
    clock reach the sidecar's /readyz (its describe + ping) once; the next second once."""
    fake = _FakeUpstreams()
    now = [0.0]
    transport = httpx.MockTransport(fake.handle)
    oip = create_oip_app(OipOptions(parse_in="thread"),
                         predict_client=httpx.AsyncClient(transport=transport),
                         sidecar_client=httpx.AsyncClient(transport=transport),
                         clock=lambda: now[0])

    async def go() -> list[int]:
        async with oip.router.lifespan_context(oip), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=oip), base_url="http://oip") as c:
            codes = [(await c.get("/v2/health/ready")).status_code for _ in range(100)]
            now[0] += 0.5
            codes += [(await c.get("/v2/models/dlrm/ready")).status_code for _ in range(100)]
            now[0] += 0.5
            codes.append((await c.get("/v2/health/ready")).status_code)
            return codes
    codes = asyncio.run(go())
    assert set(codes) == {200}
    assert [r.url.path for r in fake.seen] == ["/readyz", "/readyz"]


# --------------------------------------------------------------------------- the app


def _run(oip, *calls):
    async def go() -> list[httpx.Response]:
        async with oip.router.lifespan_context(oip), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=oip), base_url="http://oip",
                timeout=30) as c:
            return list(await asyncio.gather(*(call(c) for call in calls)))
    return asyncio.run(go())


def _app(fake: _FakeUpstreams, **options):
    transport = httpx.MockTransport(fake.handle)
    return create_oip_app(OipOptions(**{"parse_in": "thread", **options}),
                          predict_client=httpx.AsyncClient(transport=transport),
                          sidecar_client=httpx.AsyncClient(transport=transport))


def test_the_app_answers_a_stalled_upload_408_and_one_past_the_budget_429_at_once():
    fake = _FakeUpstreams()
    oip = _app(fake, max_inflight_bytes=4000, body_deadline_s=0.5)
    body, header = encode_infer_request(oip_inputs(*_arrays()), binary=True)
    refused_at: list[float] = []
    t0 = time.monotonic()

    async def stalled(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post("/v2/models/dlrm/infer", content=_chunks(b"{" * 100, stall_s=5),
                            headers={"Content-Length": "3900"})

    async def refused(c: httpx.AsyncClient) -> httpx.Response:
        await asyncio.sleep(0.1)  # the stalled one holds 3900 of 4000 bytes now
        r = await c.post("/v2/models/dlrm/infer", content=b"{" * 200)
        refused_at.append(time.monotonic() - t0)
        return r

    async def valid_after(c: httpx.AsyncClient) -> httpx.Response:
        await asyncio.sleep(0.8)  # after the deadline gave the 3900 bytes back
        return await c.post("/v2/models/dlrm/infer", content=body,
                            headers={"Inference-Header-Content-Length": str(header)})

    stall, over, ok = _run(oip, stalled, refused, valid_after)
    assert over.status_code == 429 and over.json()["error"].startswith(
        "this server holds 3900 of its 4000 bytes of bodies in flight and this request "
        "needs 200 more")
    assert over.headers["connection"] == "close" and refused_at[0] < 0.5
    assert stall.status_code == 408 and stall.json()["error"].startswith(
        "body: 100 of 3900 bytes arrived in 0.5 s")
    assert ok.status_code == 200, ok.text
    assert oip.state.oip.inflight.in_use == 0 and oip.state.oip.requests.in_use == 0


def test_the_app_refuses_infers_past_max_requests_429():
    oip = _app(_FakeUpstreams(), max_requests=1, limit_concurrency=2, body_deadline_s=0.5)

    async def stalled(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post("/v2/models/dlrm/infer", content=_chunks(b"{", stall_s=5),
                            headers={"Content-Length": "10"})

    async def second(c: httpx.AsyncClient) -> httpx.Response:
        await asyncio.sleep(0.1)
        return await c.post("/v2/models/dlrm/infer", content=b"{}")

    stall, refused = _run(oip, stalled, second)
    assert stall.status_code == 408
    assert refused.status_code == 429 and refused.json() == {"error": (
        "this server holds 1 of its 1 requests at once and this request needs 1 more; "
        "retry in a second or send smaller requests")}


def _arrays():
    ref = _reference(2)
    return ref.dense, ref.lengths, ref.values


# --------------------------------------------------------------------------- N6: dimensions


def test_the_dimension_cap_is_what_the_request_limits_allow():
    cfg = HandlerConfig()
    assert dimension_cap(cfg, spec_of(None)) == cfg.max_instances * cfg.max_ids_per_feature


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize(("name", "datatype", "shape"), [
    ("dense", "FP32", [0, HUGE]),
    ("dense", "FP32", [HUGE, 0]),
    ("C1", "INT64", [HUGE]),
    ("C1.lengths", "INT32", [2**40]),
])
def test_a_huge_dimension_is_400_naming_the_input_never_500(binary, name, datatype, shape):
    t: dict = {"name": name, "datatype": datatype, "shape": shape}
    if binary:
        t["parameters"] = {"binary_data_size": 0}
    else:
        t["data"] = []
    head = orjson.dumps({"inputs": [t]})
    cap = dimension_cap(HandlerConfig(), spec_of(None))
    with pytest.raises(InvalidInput, match=rf"^input {name}: shape is \[.*\]; each dimension "
                                           rf"must be at most {cap} \(the request limits\)"):
        parse_infer(head, header_length=len(head) if binary else None)


def test_the_app_answers_a_huge_dimension_400():
    body = orjson.dumps({"inputs": [{"name": "dense", "datatype": "FP32",
                                     "shape": [0, HUGE], "data": []}]})
    (r,) = _run(_app(_FakeUpstreams()),
                lambda c: c.post("/v2/models/dlrm/infer", content=body))
    assert r.status_code == 400 and r.json()["error"].startswith(
        f"input dense: shape is [0, {HUGE}]; each dimension must be at most")
