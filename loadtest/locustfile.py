"""Locust load test of the DLRM predict endpoint (POST /predictions/<model>).

Run it through ``python -m loadtest.run`` (which also starts the service, writes the
report and applies the thresholds), or directly::

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8080 \\
        --dlrm-shape step --dlrm-duration 60s --dlrm-stages-json /tmp/stages.json

Each user is a closed-loop client: it sends a pre-generated ranking request (see
``loadtest/traffic.py``), checks the answer (HTTP 200, one probability in [0, 1] per
instance) and sends the next. A wrong answer is a locust failure with its reason.
The load follows the shape chosen by ``--dlrm-shape`` / env ``LOAD_SHAPE``
(``loadtest/shapes.py``, ``loadtest/plan.py``); per-stage figures go to ``--dlrm-stages-json``.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locust import FastHttpUser, LoadTestShape, constant, events, task

# Locust imports this file by path; make the repository root importable for `loadtest`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Import modules, not classes: locust runs every LoadTestShape class it finds in this
# file's globals, and exactly one (DlrmShape) must be there.
from loadtest import plan as _plan
from loadtest import shapes as _shapes
from loadtest import stats as _stats
from loadtest import traffic as _traffic
from serve.profiles import PROFILES, get_profile

__all__ = ["DlrmShape", "DlrmUser"]

log = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def _add_options(parser: Any, **_: Any) -> None:
    # Prefixed with --dlrm- because locust owns --users, --profile, --run-time, ...
    parser.add_argument("--dlrm-shape", env_var="LOAD_SHAPE", default="steady",
                        choices=_plan.SHAPES, help="load shape (env LOAD_SHAPE)")
    parser.add_argument("--dlrm-duration", env_var="LOAD_DURATION", default="60s",
                        help="total run time, e.g. 60s, 5m; every stage scales with it")
    parser.add_argument("--dlrm-users", env_var="LOAD_USERS", default="",
                        help="users: N, or step levels 1,2,4,8 (default: per shape)")
    parser.add_argument("--dlrm-model", env_var="LOAD_MODEL", default="dlrm",
                        help="model name in /predictions/<model>")
    parser.add_argument("--dlrm-profile", env_var="LOAD_PROFILE", default="small",
                        choices=sorted(PROFILES),
                        help="profile of the served model (cardinalities of the id draws)")
    parser.add_argument("--dlrm-instances", default="100-700:270",
                        help="instances per ranking request: MIN-MAX[:MEAN] or N")
    parser.add_argument("--dlrm-single-fraction", type=float, default=0.1,
                        help="fraction of single-instance requests")
    parser.add_argument("--dlrm-zipf-alpha", type=float, default=0.0,
                        help="id skew (0: the profile's, as in the training data)")
    parser.add_argument("--dlrm-format", choices=_traffic.BODY_FORMATS, default="row",
                        help="request body form: row (instances list) or columnar")
    parser.add_argument("--dlrm-pool-size", type=int, default=256,
                        help="distinct request bodies generated before the test")
    parser.add_argument("--dlrm-seed", type=int, default=0, help="seed of the body pool")
    parser.add_argument("--dlrm-think-ms", type=float, default=0.0,
                        help="pause between a user's requests (0: closed loop, max load)")
    parser.add_argument("--dlrm-stages-json", default="",
                        help="write per-stage statistics (loadtest.stats) to this file")


@dataclass
class _Run:
    pool: _traffic.RequestPool
    recorder: _stats.StageRecorder
    path: str


_RUN: _Run | None = None


class DlrmShape(LoadTestShape):
    """The shape named by ``--dlrm-shape`` / ``LOAD_SHAPE``; logs each stage as it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.impl: _shapes.PlannedShape | None = None
        self._last: str | None = None

    def configure(self, cfg: _plan.ShapeConfig) -> _shapes.PlannedShape:
        self.impl = _shapes.shape_class(cfg.shape)(cfg)
        return self.impl

    def tick(self) -> tuple[int, float] | None:
        if self.impl is None:
            return None
        t = self.get_run_time()
        s = self.impl.stage_at(t)
        if s is not None and s.name != self._last:
            self._last = s.name
            log.info("stage %s: %d users, %.1fs-%.1fs (first %.1fs not measured)",
                     s.name, s.users, s.start_s, s.end_s, s.settle_s)
        return None if s is None else (s.users, s.spawn_rate)


class DlrmUser(FastHttpUser):
    """Sends pooled ranking requests and checks every answer."""

    # Generous bounds: an overloaded server should show as high latency, not as
    # client timeouts, unless it is truly stuck.
    network_timeout = 30.0
    connection_timeout = 10.0
    wait_time = constant(0)
    model = "dlrm"

    @task
    def predict(self) -> None:
        run = _RUN
        if run is None:  # pragma: no cover - init always sets it
            raise RuntimeError("locustfile not initialised: run it with locust -f")
        req = run.pool.pick()
        # Pre-encoded bytes go out as they are (locust's stub types only say str/dict).
        with self.client.post(f"/predictions/{self.model}", data=req.body,  # type: ignore[arg-type]
                              headers={"Content-Type": "application/json"},
                              name=f"/predictions/{self.model}", catch_response=True,
                              context={"instances": req.instances}) as resp:
            content = resp.content
            if not resp.status_code and getattr(resp, "error", None) is not None:
                content = repr(resp.error).encode()
            reason = _traffic.check_response(resp.status_code or 0, content, req.instances)
            if reason is None:
                resp.success()
            else:
                resp.failure(reason)


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    global _RUN
    opts = environment.parsed_options
    shape = environment.shape_class
    if opts is None or not isinstance(shape, DlrmShape):
        return  # used as a library: the caller wires its own shape and pool
    cfg = _plan.ShapeConfig(opts.dlrm_shape, _plan.parse_duration(opts.dlrm_duration),
                            _plan.parse_users(opts.dlrm_users))
    impl = shape.configure(cfg)
    profile = get_profile(opts.dlrm_profile)
    traffic_cfg = _traffic.TrafficConfig(
        profile=profile,
        instances=_traffic.InstancesDistribution.parse(opts.dlrm_instances,
                                                       opts.dlrm_single_fraction),
        zipf_alpha=opts.dlrm_zipf_alpha or profile.zipf_alpha,
        body_format=opts.dlrm_format, pool_size=opts.dlrm_pool_size, seed=opts.dlrm_seed)
    t0 = time.perf_counter()
    pool = _traffic.RequestPool(traffic_cfg)
    log.info("request pool: %d bodies, %.1f instances/request on average, %.1f KiB/body, "
             "built in %.2fs", len(pool), pool.mean_instances, pool.total_bytes / len(pool) / 1024,
             time.perf_counter() - t0)
    DlrmUser.model = opts.dlrm_model
    DlrmUser.wait_time = constant(opts.dlrm_think_ms / 1000.0)
    stages = [_stats.StageStats(s.name, s.start_s, s.end_s, s.users, s.settle_s, s.slo)
              for s in impl.stages]
    recorder = _stats.StageRecorder(stages, clock=shape.get_run_time)
    _RUN = _Run(pool, recorder, opts.dlrm_stages_json)

    def on_request(response_time: float, context: dict | None = None,
                   exception: BaseException | None = None, **_kw: Any) -> None:
        n = int((context or {}).get("instances", 0))
        recorder.record(float(response_time), exception is None, n,
                        None if exception is None else str(exception))

    def write(**_kw: Any) -> None:
        if not _RUN or not _RUN.path:
            return
        doc = {
            "shape": cfg.to_json(),
            "started_at_epoch": time.time() - shape.get_run_time(),
            "traffic": {
                "profile": profile.name, "format": traffic_cfg.body_format,
                "instances": traffic_cfg.instances.spec(),
                "single_fraction": traffic_cfg.instances.single_fraction,
                "expected_mean_instances": round(traffic_cfg.instances.expected_mean, 2),
                "pool_size": len(pool), "pool_mean_instances": round(pool.mean_instances, 2),
                "pool_mean_body_bytes": pool.total_bytes // len(pool),
                "zipf_alpha": traffic_cfg.zipf_alpha, "model": opts.dlrm_model,
            },
            "stages": [s.to_json() for s in recorder.stages],
        }
        path = Path(_RUN.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    environment.events.request.add_listener(on_request)
    environment.events.test_stop.add_listener(write)
    environment.events.quitting.add_listener(write)
