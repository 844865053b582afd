"""serve.sidecar.http.app: the app (in process and under uvicorn), the .mar rewrite, tokens, and
against a real TorchServe: metrics that move exactly, and a live PUT /batching under
continuous load with zero failed predictions."""
from __future__ import annotations

import asyncio
import json
import stat
import threading
import zipfile

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from serve.api.json_body import example_request
from serve.common.net import wait_until
from serve.errors import ConfigError, UpstreamUnavailable
from serve.ops.loadgen import BackgroundLoad
from serve.ops.state_client import StateClient
from serve.sidecar.adapters.archives import rewrite_mar
from serve.sidecar.adapters.tokens import ensure_dev_token, load_token
from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.app import create_app
from tests.fixtures.sidecar import (
    SESSION_VERSION,
    add_versions,
    dead_port,
    start_sidecar,
    toy_mar,
    wait_converged,
)
from tests.promtext import samples

RULES = ("Allowed fields: batch_size: integer 1..4096, max_batch_delay_ms: integer "
         "0..10000, workers: integer 1..64")
TOKEN = "t0ken-for-tests-t0ken-for-tests-0123"


# ------------------------------------------------------------------ units


def test_ensure_dev_token_writes_a_private_random_token_once(tmp_path):
    path = tmp_path / "run" / "sidecar-token"
    token = ensure_dev_token(path)
    assert len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_dev_token(path) == token  # present: kept, not rotated
    assert ensure_dev_token(tmp_path / "other") != token
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"token file .*empty is empty; write a token into it"):
        load_token(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"token file .*absent does not exist; create it"):
        load_token(tmp_path / "absent")


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match=r"management_url='localhost:8081' is not an http\(s\) URL"):
        SidecarConfig(management_url="localhost:8081")
    with pytest.raises(ConfigError, match=r"model_name='a/b' must be letters"):
        SidecarConfig(model_name="a/b")
    with pytest.raises(ConfigError, match=r"upstream_timeout_s=0 must be > 0 seconds"):
        SidecarConfig(upstream_timeout_s=0)


def test_rewrite_mar_sets_version_and_batching_keeps_the_rest(tmp_path):
    src = toy_mar(tmp_path / "dlrm.mar")
    dst = rewrite_mar(src, tmp_path / "dlrm-v1.1.mar", version="1.1", batch_size=32,
                      max_batch_delay_ms=7, workers=2)
    with zipfile.ZipFile(dst) as z:
        assert json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["modelVersion"] == "1.1"
        cfg = yaml.safe_load(z.read("model-config.yaml"))
        assert z.read("artifact.pt") == b"\x00\x01binary" * 1000
    assert cfg == {"minWorkers": 2, "maxWorkers": 2, "batchSize": 32, "maxBatchDelay": 7,
                   "responseTimeout": 60, "handler": {"cache_load_factor": 1.0}}
    with pytest.raises(UpstreamUnavailable, match=r"nope.mar does not exist; check --repository"):
        rewrite_mar(tmp_path / "nope.mar", tmp_path / "x.mar", version="2", batch_size=1,
                    max_batch_delay_ms=1, workers=1)


def _call(app, method: str, url: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                return await c.request(method, url, **kw)
    return asyncio.run(go())


def _calls(app, *requests: tuple[str, str]) -> list[httpx.Response]:
    """``(method, url)`` requests in one app lifespan; an exception the app lets escape
    is not raised here, so its response (Starlette's last resort) can be read."""
    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as c:
                return [await c.request(method, url) for method, url in requests]
    return asyncio.run(go())


@pytest.fixture
def dead_app(tmp_path):
    port = dead_port()
    return create_app(SidecarConfig(
        management_url=f"http://127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{port}",
        inference_url=f"http://127.0.0.1:{port}", token=TOKEN, multiproc_dir=tmp_path))


AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("body, message", [
    ({"batch_size": 0}, "batch_size: Input should be greater than or equal to 1 (got 0)"),
    ({"batch_size": 5000}, "batch_size: Input should be less than or equal to 4096 (got 5000)"),
    ({"max_batch_delay_ms": -1},
     "max_batch_delay_ms: Input should be greater than or equal to 0 (got -1)"),
    ({"workers": 65}, "workers: Input should be less than or equal to 64 (got 65)"),
    ({"batch_size": "8"}, "batch_size: Input should be a valid integer (got '8')"),
    ({"batch_size": 8.0}, "batch_size: Input should be a valid integer (got 8.0)"),
    ({"batch_size": True}, "batch_size: Input should be a valid integer (got True)"),
    ({"batchSize": 8}, "batchSize: unknown field (got 8)"),
    ({}, "body: give at least one of batch_size, max_batch_delay_ms, workers (got {})"),
    ([8], ("body: the body must be a JSON object sent with Content-Type: application/json "
           "(got [8])")),
])
def test_bad_bodies_get_400_with_the_field_and_rule(dead_app, body, message):
    r = _call(dead_app, "PUT", "/batching", json=body, headers=AUTH)
    assert r.status_code == 400
    assert r.json() == {"code": 400, "type": "InvalidInput",
                        "message": f"invalid PUT /batching body: {message}. {RULES}"}


def test_body_that_is_not_json(dead_app):
    r = _call(dead_app, "PUT", "/batching", content=b"{batch_size: 8",
              headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["message"] == (
        "invalid PUT /batching body: body: the body is not valid JSON (Expecting property "
        f"name enclosed in double quotes at character 1). {RULES}")


@pytest.mark.parametrize("headers, status, body", [
    ({}, 401, {"code": 401, "type": "Unauthorized",
               "message": "PUT /batching needs the header 'Authorization: Bearer <token>'; "
                          "the token is in the sidecar's --token-file or DLRM_SIDECAR_TOKEN"}),
    ({"Authorization": "Basic dTpw"}, 401, None),
    ({"Authorization": "Bearer wrong"}, 403,
     {"code": 403, "type": "Forbidden",
      "message": "the bearer token is wrong; use the one in the sidecar's --token-file or "
                 "DLRM_SIDECAR_TOKEN"}),
    ({"Authorization": f"Bearer {TOKEN}x"}, 403, None),
])
def test_auth(dead_app, headers, status, body):
    r = _call(dead_app, "PUT", "/batching", json={"batch_size": 4}, headers=headers)
    assert r.status_code == status
    if body is not None:
        assert r.json() == body
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_no_token_configured_disables_writes(tmp_path):
    app = create_app(SidecarConfig(management_url=f"http://127.0.0.1:{dead_port()}"))
    r = _call(app, "PUT", "/batching", json={"batch_size": 4}, headers=AUTH)
    assert r.status_code == 403 and "has no token configured" in r.json()["message"]


def test_openapi_docs_are_served(dead_app):
    assert _call(dead_app, "GET", "/docs").status_code == 200
    spec = _call(dead_app, "GET", "/openapi.json").json()
    assert {"/metrics", "/batching", "/healthz", "/readyz", "/state"} <= set(spec["paths"])
    put_state = spec["paths"]["/state"]["put"]["requestBody"]["content"]["application/json"]
    assert put_state["schema"]["$ref"] == "#/components/schemas/DesiredState"
    assert "DesiredState" in spec["components"]["schemas"]
    assert spec["components"]["schemas"]["BatchingUpdate"]["additionalProperties"] is False
    observed_model = spec["components"]["schemas"]["ObservedModel"]["properties"]
    assert observed_model["schema"]["anyOf"][0] == {"$ref": "#/components/schemas/RequestSchema"}


def test_unexpected_error_is_a_json_500_and_is_counted(tmp_path):
    registry = CollectorRegistry()
    app = create_app(SidecarConfig(management_url=f"http://127.0.0.1:{dead_port()}"),
                     registry=registry)

    async def boom() -> dict:
        raise KeyError("batchSize")

    app.add_api_route("/boom", boom, methods=["GET"])  # a route with a bug, test-only
    [r] = _calls(app, ("GET", "/boom"))
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "code": 500, "type": "InternalError",
        "message": "GET /boom failed with an unexpected KeyError: 'batchSize'; the "
                   "sidecar's log has the traceback: report it"}
    got = samples(generate_latest(registry).decode())
    assert got[("dlrm_sidecar_requests_total",
                (("code", "500"), ("method", "GET"), ("route", "/boom")))] == 1


def test_request_counts_label_only_known_routes_and_methods(tmp_path):
    registry = CollectorRegistry()
    app = create_app(SidecarConfig(management_url=f"http://127.0.0.1:{dead_port()}"),
                     registry=registry)
    answers = _calls(app, ("BREW", "/x"), ("BREW", "/healthz"), ("GET", "/nonexistent/123"),
                     ("GET", "/healthz/%2e%2e/etc/passwd"), ("PATCH", "/batching"),
                     ("HEAD", "/healthz"), ("GET", "/healthz"))
    assert [r.status_code for r in answers] == [404, 405, 404, 404, 405, 405, 200]
    got = samples(generate_latest(registry).decode())
    counted: dict[str, float] = {}
    pairs = set()
    for (name, labels), value in got.items():
        if name == "dlrm_sidecar_requests_total":
            lab = dict(labels)
            pairs.add((lab["route"], lab["method"]))
            counted[lab["code"]] = counted.get(lab["code"], 0) + value
    known_routes = {"/healthz", "/readyz", "/metrics", "/batching", "/docs", "/openapi.json",
                    "/docs/oauth2-redirect", "/redoc"}
    assert {route for route, _ in pairs} <= known_routes | {"other"}
    assert {method for _, method in pairs} <= {"GET", "HEAD", "PUT", "other"}
    # A path matched with a method it does not take keeps its template (bounded too).
    assert pairs == {("other", "other"), ("/healthz", "GET"), ("/healthz", "other"),
                     ("/batching", "other")}
    assert got[("dlrm_sidecar_requests_total",
                (("code", "404"), ("method", "other"), ("route", "other")))] == 3
    assert got[("dlrm_sidecar_requests_total",
                (("code", "405"), ("method", "other"), ("route", "/healthz")))] == 2
    assert counted == {"200": 1, "404": 3, "405": 3}


# ------------------------------------------------------------------ uvicorn, TorchServe down


@pytest.mark.integration
def test_real_sidecar_with_torchserve_down(tmp_path):
    from serve.state import DesiredState, ModelRef, write_state

    port = dead_port()
    dead = f"http://127.0.0.1:{port}"
    state_file = tmp_path / "state.yaml"
    write_state(state_file, DesiredState(model=ModelRef(version="toy")))
    sc = start_sidecar(tmp_path, management_url=dead, metrics_url=dead, inference_url=dead,
                       model_name="dlrm", multiproc_dir=tmp_path / "prom",
                       model_store=tmp_path / "store", state_file=state_file,
                       repositories=[add_versions(tmp_path / "repo", ["toy"])])
    try:
        with httpx.Client(base_url=sc.write_url, timeout=30) as c:  # reads there too
            assert c.get("/healthz").json() == {"status": "alive"}
            r = c.get("/readyz")
            assert r.status_code == 503
            assert r.json()["type"] == "UpstreamUnavailable"
            assert r.json()["message"].startswith(
                f"TorchServe management API at {dead}/models/dlrm did not answer (ConnectError")
            r = c.get("/metrics")
            assert r.status_code == 200
            got = samples(r.text)
            assert got[("dlrm_upstream_up", (("target", "management"),))] == 0
            assert got[("dlrm_upstream_up", (("target", "metrics"),))] == 0
            assert not any(name.startswith("ts_") for name, _ in got)
            assert c.get("/batching").status_code == 503
            declared = state_file.read_text()
            r = c.put("/batching", json={"batch_size": 3},
                      headers={"Authorization": f"Bearer {sc.token}"})
            assert r.status_code == 503
            assert state_file.read_text() == declared  # refused before writing
            r = c.get("/state")
            assert r.status_code == 200 and r.json()["converged"] is False
            assert r.json()["reason"].startswith(
                f"TorchServe did not answer: TorchServe management API at {dead}/models/dlrm"
                f"/all did not answer (ConnectError")
            assert c.put("/batching", json={"batch_size": 3}).status_code == 401
            r = c.get("/metrics")
            got = samples(r.text)
            assert got[("dlrm_batching_updates_total", (("result", "failed"),))] == 1
            assert got[("dlrm_sidecar_requests_total",
                        (("code", "503"), ("method", "GET"), ("route", "/readyz")))] == 1
    finally:
        sc.stop()


# ------------------------------------------------------------------ against real TorchServe


def _metrics(sidecar) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{sidecar.url}/metrics", timeout=30)
    assert r.status_code == 200
    return samples(r.text)


def _value(s: dict, name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.integration
def test_readyz_and_batching_read_torchserve(sidecar, torchserve):
    r = httpx.get(f"{sidecar.url}/readyz", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ready" and r.json()["ready_workers"] >= 1
    got = httpx.get(f"{sidecar.url}/batching", timeout=30).json()
    desc = httpx.get(f"{torchserve.management_url}/models/{torchserve.model_name}",
                     timeout=30).json()[0]
    assert got == {"batch_size": desc["batchSize"], "max_batch_delay_ms": desc["maxBatchDelay"],
                   "workers": len(desc["workers"]), "model_version": desc["modelVersion"]}


@pytest.mark.integration
def test_state_file_is_served_by_a_real_torchserve(sidecar, torchserve):
    """The session's sidecar took TorchServe from the archive it started with to the
    declared repository version; predictions name the version that computed them; a
    version change declared with PUT /state is served without a failed request."""
    from serve.store.repository import ModelRepository

    state = wait_converged(sidecar.url)
    print("\nGET /state:", json.dumps(state, indent=2))
    want = state["desired"]
    assert want["model"] == {"version": SESSION_VERSION}
    observed = state["observed"]
    # observed.model also carries the version's schema (null: this fixture's report has none)
    assert observed["model"] == {**want["model"], "schema": None}
    assert {k: observed[k] for k in want if k not in ("rollout", "model")} == {
        k: v for k, v in want.items() if k not in ("rollout", "model")}
    assert want["rollout"] is None and observed["candidate"] is None
    assert observed["ready_workers"] == want["workers"]
    assert observed["registered_versions"] == [state["target_serving_version"]]
    assert state["reason"] is None and state["last_error"] is None
    assert state["phase"] == "idle" and state["state_file_writable"] is True
    switch = state["last_switch"]
    assert switch["ok"] is True and switch["to"] == observed["serving_version"]
    assert switch["peak_workers_rss_bytes"] > 0 and switch["peak_memory_bytes"] > 0
    good = httpx.post(torchserve.predict_url, json=example_request(3), timeout=60)
    bad = httpx.post(torchserve.predict_url, json={"instances": []}, timeout=60)
    assert good.status_code == 200 and bad.status_code == 400
    assert good.headers["x-dlrm-model-version"] == SESSION_VERSION
    assert bad.headers["x-dlrm-model-version"] == SESSION_VERSION  # errors too

    other = "tiny-session-2"
    repo = ModelRepository(sidecar.repositories)
    if not repo.exists(other):
        repo.add(other, torchserve.mar, {"created_at": "2026-12-31T00:00:00Z"})
    client = StateClient(sidecar.write_url, sidecar.token)
    load = BackgroundLoad(torchserve.predict_url,
                          [json.dumps(example_request(2, seed=i)).encode() for i in range(2)],
                          clients=2, timeout_s=60)
    try:
        load.start()
        r = client.put_state({**want, "model": {"version": other}})
        assert r.status_code == 202, r.text
        assert r.json()["converged"] is False
        changed = wait_converged(sidecar.url)
        # Its report (above) has neither a schema nor a profile to derive one from.
        assert changed["observed"]["model"] == {"version": other, "schema": None}
        assert changed["available_versions"] == [SESSION_VERSION, other]
        assert changed["last_switch"]["from"] == observed["serving_version"]
        count = len(load.answers) + load.failed
        wait_until(lambda: len(load.answers) + load.failed > count + 10,
                   timeout_s=60, what="predictions after the switch")
    finally:
        load.stop()
        restored = client.put_state(want)
        back = wait_converged(sidecar.url)
    seen = load.answers
    print(f"version change under load: {len(seen) + load.failed} predictions, "
          f"{load.failed} failed")
    assert load.failures == [], load.failures[:5]
    assert {a.version for a in seen} == {SESSION_VERSION, other}
    for k in range(load.clients):  # each client moved from the old version to the new one, once
        versions = [a.version for a in seen if a.client == k]
        last_old = max(i for i, v in enumerate(versions) if v == SESSION_VERSION) \
            if SESSION_VERSION in versions else -1
        assert all(v == other for v in versions[last_old + 1:])
        assert versions[-1] == other
    assert restored.status_code == 202
    assert back["observed"]["model"]["version"] == SESSION_VERSION


@pytest.mark.integration
def test_metrics_move_by_exactly_the_requests_sent(sidecar, torchserve):
    before = _metrics(sidecar)
    sizes = [1, 3, 5, 2, 7]
    bad = {"instances": [{"dense": [0.0] * 12, "sparse": {}}]}
    with httpx.Client(timeout=60) as c:
        for i, n in enumerate(sizes):  # one at a time: each is its own forward
            r = c.post(torchserve.predict_url, json=example_request(n, seed=i))
            assert r.status_code == 200, r.text
            assert len(r.json()["predictions"]) == n
        for _ in range(2):
            assert c.post(torchserve.predict_url, json=bad).status_code == 400
    after = _metrics(sidecar)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("dlrm_requests_total", code="200") == len(sizes)
    assert delta("dlrm_requests_total", code="400") == 2
    assert delta("dlrm_instances_total") == sum(sizes)
    assert delta("dlrm_request_duration_seconds_count") == len(sizes) + 2
    assert delta("dlrm_batch_requests_count") == len(sizes)
    assert delta("dlrm_batch_requests_bucket", le="1.0") == len(sizes)
    assert delta("dlrm_batch_instances_sum") == sum(sizes)
    assert delta("dlrm_stage_duration_seconds_count", stage="dense") == len(sizes)
    assert delta("dlrm_cache_hits_total") + delta("dlrm_cache_misses_total") > 0
    assert 0.0 <= _value(after, "dlrm_cache_hit_ratio") <= 1.0
    assert _value(after, "dlrm_workers", status="READY") >= 1
    assert _value(after, "dlrm_upstream_up", target="metrics") == 1
    assert _value(after, "dlrm_upstream_up", target="management") == 1
    assert any(name.startswith("ts_") for name, _ in after)


ACTIVE = {"copying", "registering", "waiting_ready", "setting_default", "draining",
          "unregistering"}


def _switch_phase(sidecar) -> str:
    """The running switch's phase from GET /batching ("idle" when none runs)."""
    return httpx.get(f"{sidecar.url}/batching", timeout=30).json().get("switch_phase", "idle")


def _put(sidecar, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.put(f"{sidecar.write_url}/batching", json=body, timeout=timeout,
                     headers={"Authorization": f"Bearer {sidecar.token}"})


@pytest.mark.integration
def test_live_batching_change_under_load_fails_no_request(sidecar, torchserve):
    original = httpx.get(f"{sidecar.url}/batching", timeout=30).json()
    threads = 6
    restored: list[httpx.Response] = []
    try:
        bodies = [json.dumps(example_request(4, seed=i)).encode() for i in range(threads)]
        with BackgroundLoad(torchserve.predict_url, bodies, clients=threads, timeout_s=60,
                            expect_predictions=4) as load:
            load.wait_for(load.served + 20)
            # The one worker's cache footprint; the scrape also lets the sidecar see its pid.
            base = _metrics(sidecar)
            footprint = (_value(base, "dlrm_cache_device_bytes")
                         + _value(base, "dlrm_cache_host_bytes"))
            assert footprint > 0
            # 1) down to batch_size 1, with a second PUT racing it: that one gets 409.
            result: dict = {}
            first = threading.Thread(
                target=lambda: result.update(r=_put(sidecar, {"batch_size": 1})))
            first.start()
            # The second PUT goes once the first holds the lock: its switch has started
            # (GET /batching shows a phase). Registering takes seconds (a worker loads).
            wait_until(lambda: not first.is_alive() or _switch_phase(sidecar) in ACTIVE,
                       timeout_s=60, what="the first PUT's switch", interval_s=0.02)
            assert first.is_alive(), f"the first PUT ended before the race: {result}"
            second = _put(sidecar, {"batch_size": 3})
            first.join()
            assert second.status_code == 409, second.text
            assert second.json()["type"] == "Conflict"
            r = result["r"]
            assert r.status_code == 200, r.text
            assert r.json()["batch_size"] == 1 and r.json()["changed"] is True
            assert r.json()["previous"] == original
            assert r.json()["removed_version"] == original["model_version"]
            now = httpx.get(f"{sidecar.url}/batching", timeout=30).json()
            assert now["batch_size"] == 1
            assert now["max_batch_delay_ms"] == original["max_batch_delay_ms"]
            assert now["model_version"] != original["model_version"]
            # Every forward after the switch holds exactly one request.
            s0 = _metrics(sidecar)
            load.wait_for(load.served + 30)
            s1 = _metrics(sidecar)
            forwards = (_value(s1, "dlrm_batch_requests_count")
                        - _value(s0, "dlrm_batch_requests_count"))
            singles = (_value(s1, "dlrm_batch_requests_bucket", le="1.0")
                       - _value(s0, "dlrm_batch_requests_bucket", le="1.0"))
            assert forwards >= 30 and singles == forwards
            # The old worker is gone: its live gauges no longer count (one worker's bytes).
            assert (_value(s1, "dlrm_cache_device_bytes")
                    + _value(s1, "dlrm_cache_host_bytes")) == footprint

            # 2) up to batch_size 16 with a longer delay: batches of more than the old
            #    size (1) appear in the histogram, at most the number of clients.
            r = _put(sidecar, {"batch_size": 16, "max_batch_delay_ms": 100})
            assert r.status_code == 200, r.text
            assert httpx.get(f"{sidecar.url}/batching", timeout=30).json()["batch_size"] == 16
            s2 = _metrics(sidecar)
            load.wait_for(load.served + 60)
            s3 = _metrics(sidecar)

            def d(name: str, **labels: str) -> float:
                return _value(s3, name, **labels) - _value(s2, name, **labels)

            forwards = d("dlrm_batch_requests_count")
            assert forwards > 0
            assert forwards - d("dlrm_batch_requests_bucket", le="1.0") > 0  # > old size
            assert d("dlrm_batch_requests_bucket", le=f"{threads}.0") == forwards
        print(f"\nlive PUT /batching under load: {load.served} ok, {load.failed} failed")
        assert load.failures == [], load.failures[:5]
        assert _value(s3, "dlrm_batching_updates_total", result="applied") >= 2
        assert _value(s3, "dlrm_batching_updates_total", result="conflict") >= 1
    finally:
        # Leave the session's TorchServe as the other tests expect it (checked below, so
        # that a failure above is the one reported).
        restored.append(_put(sidecar, {"batch_size": original["batch_size"],
                                       "max_batch_delay_ms": original["max_batch_delay_ms"],
                                       "workers": original["workers"]}))
        # Settings as they are: nothing to register.
        restored.append(_put(sidecar, {"batch_size": original["batch_size"]}))
    r = restored[0]
    assert r.status_code == 200, r.text
    r = restored[1]
    assert r.status_code == 200 and r.json()["changed"] is False, r.text
