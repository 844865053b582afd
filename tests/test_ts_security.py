"""TorchServe's model-loading door and frontend limits.

Fast (no server): the shipped configs (config.properties, k8s/configmap.yaml) keep
job_queue_size x max_request_size within half the JVM heap and max_request_size within the
handler's body limit; the launcher pins management and gRPC to loopback, limits
allowed_urls to the model store, and keeps DLRM_*TOKEN* out of TorchServe's environment.

Integration (a real TorchServe started by serve.ops.launcher, on free ports, with --host
127.0.0.1 and again 0.0.0.0): registering a remote URL, a file:// URL or a path outside
the store is refused and TorchServe opens no connection; management and gRPC listen on
127.0.0.1 only while inference follows --host; the workers' environment lacks the
sidecar's token; and a short run of bench.ts_limits (64 clients posting 31 MiB bodies
beside valid requests) leaves TorchServe and its workers up with >= 99% of the valid
requests answered 200 (the full 60 s run: `make ts-limits`).
"""
from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
import yaml

from serve.api.config import HandlerConfig
from serve.api.json_body import example_request
from serve.common.net import free_ports
from serve.errors import ConfigError
from serve.ops.launch_config import LaunchConfig
from serve.ops.launch_processes import allowed_urls, render_ts_config, without_blacklisted
from serve.ops.launcher import Service

REPO = Path(__file__).resolve().parents[1]
TOKEN_VAR = "DLRM_SIDECAR_TOKEN"
SECRET = "ts-security-test-secret-0123456789"


def _properties(text: str) -> dict[str, str]:
    """Java .properties key=value lines (backslash escapes undone), # comments skipped."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", "!")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().replace("\\\\", "\\")
    return out


def _shipped() -> dict[str, dict[str, str]]:
    cm = next(d for d in yaml.safe_load_all((REPO / "k8s" / "configmap.yaml").read_text())
              if d and d.get("kind") == "ConfigMap"
              and d["metadata"]["name"] == "dlrm-serve-torchserve")
    return {"config.properties": _properties((REPO / "config.properties").read_text()),
            "k8s/configmap.yaml": _properties(cm["data"]["config.properties"])}


def _heap_bytes(vmargs: str) -> int:
    m = re.search(r"-Xmx(\d+)([kKmMgG])", vmargs)
    assert m, f"vmargs {vmargs!r} must bound the JVM heap with -Xmx"
    return int(m.group(1)) * 1024 ** {"k": 1, "m": 2, "g": 3}[m.group(2).lower()]


# ------------------------------------------------------------------ fast: the configs


@pytest.mark.parametrize("where", ["config.properties", "k8s/configmap.yaml"])
def test_queue_of_full_bodies_fits_half_the_heap(where: str) -> None:
    p = _shipped()[where]
    heap, queue, body = (_heap_bytes(p["vmargs"]), int(p["job_queue_size"]),
                         int(p["max_request_size"]))
    assert queue * body <= heap / 2, (
        f"{where}: job_queue_size {queue} x max_request_size {body} = {queue * body} bytes > "
        f"half the heap ({heap // 2}): lower one of them or raise -Xmx")
    assert "-XX:+ExitOnOutOfMemoryError" in p["vmargs"]
    # TorchServe never lets through a body the handler would refuse for its size
    assert body <= HandlerConfig().max_body_bytes
    assert int(p["max_response_size"]) <= body


def test_archives_keep_the_configs_queue_size() -> None:
    """A model-config.yaml ``jobQueueSize`` would replace job_queue_size for that model
    (TorchServe 0.12 wlm/Model.java) and escape the heap arithmetic: ours sets none."""
    from serve.model.archive import model_config

    assert not {"jobQueueSize", "job_queue_size"} & set(model_config())


def test_largest_legitimate_request_fits_the_limits() -> None:
    """4096 one-hot instances of the largest shipped schema (the default: 13 dense, 26
    features), in the largest form (JSON rows), pass both limits."""
    body = len(orjson.dumps(example_request(HandlerConfig().max_instances, seed=0)))
    limit = min(int(p["max_request_size"]) for p in _shipped().values())
    assert body <= limit <= HandlerConfig().max_body_bytes, (body, limit)


@pytest.mark.parametrize("where", ["config.properties", "k8s/configmap.yaml"])
def test_shipped_doors(where: str) -> None:
    p = _shipped()[where]
    assert p["management_address"].startswith("http://127.0.0.1:")
    assert p["grpc_inference_address"] == p["grpc_management_address"] == "127.0.0.1"
    deny = re.compile(p["blacklist_env_vars"])
    assert deny.fullmatch(TOKEN_VAR) and deny.fullmatch("DLRM_OTHER_TOKEN_FILE")
    assert not deny.fullmatch("DLRM_DELTA_DIR") and not deny.fullmatch("PATH")
    urls = re.compile(p["allowed_urls"], re.IGNORECASE)
    store = p["model_store"] if p["model_store"].startswith("/") else "model_store"
    assert urls.fullmatch(f"file://{store}/dlrm-small-int8-s7_b2d2w2.mar")
    for bad in ("http://127.0.0.1:9/x.mar", "https://example.com/dlrm-1.mar",
                "file:///etc/passwd", f"file://{store}/../dlrm-1.mar", f"file://{store}/x.mar",
                f"file://{store}/sub/dlrm-1.mar", f"file://{store}/dlrm-1.mar,http://x/y.mar"):
        assert not urls.fullmatch(bad), bad


def _cfg(tmp_path: Path, host: str = "127.0.0.1", **kw: Any) -> LaunchConfig:
    inf, mgmt, met, side, gi, gm = free_ports(6)
    return LaunchConfig(**{
        "host": host, "inference_port": inf, "management_port": mgmt, "metrics_port": met,
        "sidecar_port": side, "grpc_inference_port": gi, "grpc_management_port": gm,
        "model_store": tmp_path / "model store+x", "run_dir": tmp_path / "run",
        "log_dir": tmp_path / "logs", "sidecar": False, **kw})


def test_render_pins_management_and_grpc_to_loopback(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, host="0.0.0.0")
    out = _properties(render_ts_config((REPO / "config.properties").read_text(), cfg))
    assert out["inference_address"] == f"http://0.0.0.0:{cfg.inference_port}"
    assert out["metrics_address"] == f"http://0.0.0.0:{cfg.metrics_port}"
    assert out["management_address"] == f"http://127.0.0.1:{cfg.management_port}"
    assert out["grpc_inference_address"] == out["grpc_management_address"] == "127.0.0.1"
    assert cfg.management_url == f"http://127.0.0.1:{cfg.management_port}"
    # allowed_urls: exactly the archives of this store (special characters escaped)
    urls = re.compile(out["allowed_urls"], re.IGNORECASE)
    assert out["allowed_urls"] == allowed_urls(cfg.model_store, "dlrm").replace("\\\\", "\\")
    assert urls.fullmatch(f"file://{cfg.model_store}/dlrm-1.0.mar")
    assert not urls.fullmatch(f"file://{tmp_path}/model store_x/dlrm-1.0.mar")
    with pytest.raises(ConfigError, match="stay on 127.0.0.1"):
        render_ts_config("", _cfg(tmp_path, ts_overrides={
            "management_address": "http://0.0.0.0:1"}))


def test_launcher_keeps_tokens_out_of_torchservers_environment() -> None:
    conf = (REPO / "config.properties").read_text()
    env = {TOKEN_VAR: SECRET, "DLRM_X_TOKEN_FILE": "/t", "DLRM_DELTA_DIR": "/d", "PATH": "/b"}
    assert without_blacklisted(env, conf) == {"DLRM_DELTA_DIR": "/d", "PATH": "/b"}
    assert without_blacklisted(env, "job_queue_size=1\n") == env
    with pytest.raises(ConfigError, match="not a valid regex"):
        without_blacklisted(env, "blacklist_env_vars=(\n")


# ------------------------------------------------------------------ integration


@dataclass
class Running:
    cfg: LaunchConfig
    svc: Service
    root: Path

    @property
    def java(self) -> psutil.Process:
        tree = psutil.Process(self.svc.torchserve.pid).children(recursive=True)
        return next(p for p in tree if "java" in p.name())

    def workers(self) -> list[psutil.Process]:
        out = []
        for p in self.java.children(recursive=True):
            try:
                if any("model_service_worker" in part for part in p.cmdline()):
                    out.append(p)
            except psutil.Error:
                continue
        return out


@pytest.fixture(scope="module")
def tiny_mar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serve.model.archive import build_mar
    from tests.fixtures.torchserve import HANDLER_CONFIG, tiny_random_artifact

    root = tmp_path_factory.mktemp("ts-security-mar")
    artifact = tiny_random_artifact(root / "artifact.pt", seed=0)
    return build_mar(artifact, root / "model_store", model_name="dlrm", version="1.0",
                     batch_size=4, max_batch_delay_ms=5, handler_config=HANDLER_CONFIG,
                     min_workers=1, max_workers=1, response_timeout_s=60)


@pytest.fixture(scope="module", params=["127.0.0.1", "0.0.0.0"])
def running(request: pytest.FixtureRequest, tiny_mar: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    from serve.ops.launcher import start

    root = tmp_path_factory.mktemp("ts-security")
    cfg = _cfg(root, host=request.param, mar_name=tiny_mar.name, ready_timeout_s=180,
               model_store=tiny_mar.parent,
               extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                          TOKEN_VAR: SECRET})  # TorchServe has it; its workers must not
    svc = start(cfg)
    try:
        yield Running(cfg, svc, root)
    finally:
        svc.stop()


class _Listener:
    """A TCP listener on 127.0.0.1 that records whether anything connected."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])

    def connected_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return False
        conn.close()
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.mark.integration
def test_registration_by_url_is_refused_without_a_connection(running: Running) -> None:
    mgmt = running.cfg.management_url
    listener = _Listener()
    try:
        r = httpx.post(f"{mgmt}/models", timeout=30, params={
            "url": f"http://127.0.0.1:{listener.port}/x.mar", "model_name": "evil"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert "does not match any allowed URL" in r.text
        assert not listener.connected_within(2.0), "TorchServe opened a connection to the URL"
    finally:
        listener.close()
    for url in ("file:///etc/passwd", "/etc/passwd", "../../etc/passwd",
                f"file://{running.root}/dlrm-1.0.mar"):
        r = httpx.post(f"{mgmt}/models", params={"url": url}, timeout=30)
        assert 400 <= r.status_code < 500, (url, r.status_code, r.text)
    # the archive of the store still registers by its plain name (what the sidecar does)
    r = httpx.get(f"{mgmt}/models", timeout=30)
    assert [m["modelName"] for m in r.json()["models"]] == ["dlrm"]


@pytest.mark.integration
def test_management_and_grpc_listen_on_loopback_only(running: Running) -> None:
    cfg = running.cfg
    listening: dict[int, set[str]] = {}
    for c in running.java.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN:
            # Java binds IPv6 sockets: 127.0.0.1 shows as ::ffff:127.0.0.1, 0.0.0.0 as ::
            ip = c.laddr.ip.removeprefix("::ffff:")
            listening.setdefault(c.laddr.port, set()).add("0.0.0.0" if ip == "::" else ip)
    for port in (cfg.management_port, cfg.grpc_management_port, cfg.grpc_inference_port):
        assert listening.get(port) == {"127.0.0.1"}, (port, listening)
    assert listening.get(cfg.inference_port) == {cfg.host}, listening
    assert listening.get(cfg.metrics_port) == {cfg.host}, listening
    # and the loopback management API answers
    assert httpx.get(f"{cfg.management_url}/models", timeout=30).status_code == 200


@pytest.mark.integration
def test_workers_environment_lacks_the_sidecar_token(running: Running) -> None:
    def environ(p: psutil.Process) -> dict[str, str]:
        raw = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        return dict(e.decode(errors="replace").partition("=")[::2] for e in raw if e)

    assert environ(running.java).get(TOKEN_VAR) == SECRET  # extra_env gave it to TorchServe
    workers = running.workers()
    assert workers, "no TorchServe worker found"
    for w in workers:
        env = environ(w)
        assert TOKEN_VAR not in env and SECRET not in "".join(env.values()), w.pid
        assert "PYTHONPATH" in env  # a real worker environment, not an empty read


@pytest.mark.integration
def test_oversized_bodies_leave_torchserve_serving(running: Running) -> None:
    """A short bench.ts_limits run (`make ts-limits` runs it for 60 s)."""
    from bench.ts_limits import run

    if running.cfg.host != "127.0.0.1":
        pytest.skip("the limits do not depend on --host: once is enough")
    result = run(running.cfg.inference_url, running.cfg.management_url,
                 running.svc.torchserve.pid, seconds=10, big_clients=64, body_mib=31)
    doc = result.as_dict()
    assert result.ok, doc
