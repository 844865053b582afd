"""TorchServe's heap under in-limit bodies (review F8): many connections trickling bodies
just under ``max_request_size`` and both versions' job queues full during a switch.

Fast: the shipped configs (config.properties, k8s/configmap.yaml) keep what the frontend
may hold within its memory: every trickling connection's aggregated body and both
versions' queued bodies fit the direct-buffer budget the JVM declares, the queues fit half
the heap, and the largest legitimate request still passes.

Integration (a real TorchServe, ~30 s of load): a short ``bench.ts_heap`` run, 200
connections holding ``max_request_size - 1`` bytes each, a switch to version 2.0 with 64
clients per version posting bodies of the same size, beside a valid stream: the JVM and
the worker keep their pids, no OutOfMemoryError is logged, >= 99% of the valid requests
are answered 200; and a body of 8 MiB - 1 byte is refused from its headers (413) without
being held. ``make ts-heap`` runs the same for 60 s.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import orjson
import pytest

from serve.api.config import HandlerConfig
from serve.api.json_body import example_request
from tests.test_ts_security import _heap_bytes, _shipped

#: The load the configs are sized for (bench.ts_heap's defaults, review F8).
TRICKLERS, VERSIONS = 200, 2
MIB = 1024 * 1024


def _direct_bytes(vmargs: str) -> int:
    m = re.search(r"-XX:MaxDirectMemorySize=(\d+)([kKmMgG])", vmargs)
    if m is None:   # the JVM's default: as large as the heap
        return _heap_bytes(vmargs)
    return int(m.group(1)) * 1024 ** {"k": 1, "m": 2, "g": 3}[m.group(2).lower()]


@pytest.mark.parametrize("where", ["config.properties", "k8s/configmap.yaml"])
def test_trickling_connections_and_two_queues_fit_the_frontends_memory(where: str) -> None:
    p = _shipped()[where]
    body, queue = int(p["max_request_size"]), int(p["job_queue_size"])
    held = (TRICKLERS + VERSIONS * queue) * body
    assert held <= _direct_bytes(p["vmargs"]), (
        f"{where}: {TRICKLERS} connections + {VERSIONS} x {queue} queued bodies of "
        f"{body} bytes = {held / MIB:.0f} MiB of netty buffers > the direct budget "
        f"({_direct_bytes(p['vmargs']) / MIB:.0f} MiB): lower max_request_size or "
        "job_queue_size, or raise -XX:MaxDirectMemorySize (and the pod's memory rule)")
    assert VERSIONS * queue * body <= _heap_bytes(p["vmargs"]) / 2
    legit = len(orjson.dumps(example_request(HandlerConfig().max_instances, seed=0)))
    assert legit <= body, (legit, body)


@pytest.mark.integration
def test_trickling_bodies_and_a_switch_with_full_queues_leave_torchserve_serving() -> None:
    from bench.ts_heap import build_store, run
    from serve.common.net import free_ports
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launcher import start

    body = int(_shipped()["config.properties"]["max_request_size"]) - 1
    root = Path(tempfile.mkdtemp(prefix="ts-heap-"))
    build_store(root / "store")
    inf, mgmt, met, side, gi, gm = free_ports(6)
    cfg = LaunchConfig(inference_port=inf, management_port=mgmt, metrics_port=met,
                       sidecar_port=side, grpc_inference_port=gi, grpc_management_port=gm,
                       model_store=root / "store", mar_name="dlrm-1.0.mar", sidecar=False,
                       run_dir=root / "run", log_dir=root / "logs", ready_timeout_s=180,
                       extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    svc = start(cfg)
    try:
        over = run(cfg.inference_url, cfg.management_url, svc.torchserve.pid, seconds=6,
                   tricklers=1, body_bytes=8 * MIB - 1, second_mar=None, valid_rps=5,
                   ts_log=cfg.path(cfg.log_dir) / "ts_log.log")
        assert dict(over.trickle) == {"answered 413": 1}, over.as_dict()
        result = run(cfg.inference_url, cfg.management_url, svc.torchserve.pid, seconds=24,
                     tricklers=TRICKLERS, body_bytes=body, fillers=64, filler_bytes=body,
                     valid_rps=20, ts_log=cfg.path(cfg.log_dir) / "ts_log.log")
    finally:
        svc.stop()
    doc = result.as_dict()
    assert result.switch.get("register_status") == 200, doc
    assert doc["trickle_by_outcome"] == {"held to the end": TRICKLERS}, doc
    assert any(k.startswith("2.0 ") for k in doc["fill_by_status"]), doc
    assert result.ok, doc
