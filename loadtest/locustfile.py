"""Locust load test of the DLRM predict endpoint (POST /predictions/<model>).

Run it through ``python -m loadtest.run`` (``make loadtest``: starts the service, runs a
shape, writes the report and applies the thresholds), or directly with locust, which
then works as locust always does: ``-u``/``-r``/``-t`` or the web UI set the load::

    locust -f loadtest/locustfile.py --headless -u 2 -r 2 -t 10s -H http://127.0.0.1:8080
    locust -f loadtest/locustfile.py -H http://127.0.0.1:8080      # web UI on :8089

A load shape drives the run only when one is asked for with ``--dlrm-shape``::

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8080 \\
        --dlrm-shape step --dlrm-duration 60s --dlrm-stages-json /tmp/stages.json

Each user is a closed-loop client: it sends a pre-generated ranking request (see
``loadtest/traffic.py``), checks the answer (HTTP 200, one probability in [0, 1] per
instance) and sends the next. A wrong answer is a locust failure with its reason.
With a shape (``loadtest/shapes.py``, ``loadtest/plan.py``), per-stage figures go to
``--dlrm-stages-json``.
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

import gevent
from locust import FastHttpUser, LoadTestShape, constant, events, task

# Locust imports this file by path; make the repository root importable for `loadtest`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Import modules, not classes: locust picks up every non-abstract LoadTestShape class in
# this file's globals, and a shape found there takes -u/-r/-t away from the user. None
# may be there: DlrmShape is abstract, and installed by _on_init only for --dlrm-shape.
from loadtest import plan as _plan
from loadtest import shapes as _shapes
from loadtest import stats as _stats
from loadtest import traffic as _traffic
from serve.errors import ConfigError
from serve.profiles import PROFILES, get_profile

__all__ = ["DlrmShape", "DlrmUser"]

log = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def _add_options(parser: Any, **_: Any) -> None:
    # Prefixed with --dlrm- because locust owns --users, --profile, --run-time, ...
    # Kept out of the web UI: they are read once, at start-up (the request pool, the
    # shape), so a field in the UI would change nothing.
    def add(*args: Any, **kwargs: Any) -> None:
        parser.add_argument(*args, include_in_web_ui=False, **kwargs)

    # No env var on purpose: an exported LOAD_SHAPE (loadtest.run's default) must not
    # silently turn a plain `locust -f` run into a shaped one.
    add("--dlrm-shape", default=None, choices=_plan.SHAPES,
        help="run this load shape instead of locust's -u/-r/-t (default: none: "
             "locust's own options or web UI set the load)")
    add("--dlrm-duration", env_var="LOAD_DURATION", default="60s",
        help="with --dlrm-shape: total run time, e.g. 60s, 5m; every stage scales with it")
    add("--dlrm-users", env_var="LOAD_USERS", default="",
        help="with --dlrm-shape: users, N or step levels 1,2,4,8 (default: per shape)")
    add("--dlrm-model", env_var="LOAD_MODEL", default="dlrm",
        help="model name in /predictions/<model>")
    add("--dlrm-profile", env_var="LOAD_PROFILE", default="small", choices=sorted(PROFILES),
        help="profile of the served model (cardinalities of the id draws)")
    add("--dlrm-instances", default="100-700:270",
        help="instances per ranking request: MIN-MAX[:MEAN] or N")
    add("--dlrm-single-fraction", type=float, default=0.1,
        help="fraction of single-instance requests")
    add("--dlrm-zipf-alpha", type=float, default=0.0,
        help="id skew (0: the profile's, as in the training data)")
    add("--dlrm-format", choices=_traffic.BODY_FORMATS, default="row",
        help="request body form: row (instances list) or columnar")
    add("--dlrm-form", choices=_traffic.REQUEST_FORMS, default="context",
        help="ranking request form: context (the user's features and dense once, the "
             "items' per candidate) or instances (every candidate carries everything)")
    add("--dlrm-context-features", default="",
        help="comma-separated features sent as the context (default: the profile's "
             "declared user-side features, C1..C13 built in)")
    add("--dlrm-pool-size", type=int, default=256,
        help="distinct request bodies generated before the test")
    add("--dlrm-seed", type=int, default=0, help="seed of the body pool")
    add("--dlrm-think-ms", type=float, default=0.0,
        help="pause between a user's requests (0: closed loop, max load)")
    add("--dlrm-stages-json", default="",
        help="with --dlrm-shape: write per-stage statistics (loadtest.stats) to this file")


@dataclass
class _Run:
    pool: _traffic.RequestPool


_RUN: _Run | None = None


class DlrmShape(LoadTestShape):
    """The shape named by ``--dlrm-shape``; logs each stage as it starts.

    ``abstract`` keeps locust from picking it up from this file's globals (it would then
    run in every test and ignore -u/-r/-t); ``_on_init`` installs it when asked for.
    """

    abstract = True

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


def _traffic_config(opts: Any) -> _traffic.TrafficConfig:
    profile = get_profile(opts.dlrm_profile)
    return _traffic.TrafficConfig(
        profile=profile,
        instances=_traffic.InstancesDistribution.parse(opts.dlrm_instances,
                                                       opts.dlrm_single_fraction),
        zipf_alpha=opts.dlrm_zipf_alpha or profile.zipf_alpha,
        body_format=opts.dlrm_format, pool_size=opts.dlrm_pool_size, seed=opts.dlrm_seed,
        form=opts.dlrm_form,
        context_features=_traffic.parse_features(opts.dlrm_context_features))


def _build_pool(traffic_cfg: _traffic.TrafficConfig) -> _traffic.RequestPool:
    t0 = time.perf_counter()
    pool = _traffic.RequestPool(traffic_cfg)
    log.info("request pool: %d bodies, %.1f instances/request on average, %.1f KiB/body, "
             "built in %.2fs", len(pool), pool.mean_instances, pool.total_bytes / len(pool) / 1024,
             time.perf_counter() - t0)
    return pool


def _install_shape(environment: Any, runner: Any, opts: Any) -> DlrmShape:
    """Make ``--dlrm-shape`` drive the run: what locust does with a shape class it found."""
    shape = DlrmShape()
    shape.configure(_plan.ShapeConfig(opts.dlrm_shape, _plan.parse_duration(opts.dlrm_duration),
                                      _plan.parse_users(opts.dlrm_users)))
    shape.runner = runner
    environment.shape_class = shape
    environment.available_shape_classes = {type(shape).__name__: shape}
    ignored = [flag for flag, value in (("-u/--users", opts.num_users),
                                        ("-r/--spawn-rate", opts.spawn_rate)) if value]
    if ignored:
        log.warning("--dlrm-shape %s sets the users; %s ignored (use --dlrm-users)",
                    opts.dlrm_shape, ", ".join(ignored))
    return shape


def _record_stages(environment: Any, shape: DlrmShape, traffic_cfg: _traffic.TrafficConfig,
                   pool: _traffic.RequestPool, opts: Any) -> None:
    """Route every request to its stage; write the stages to ``--dlrm-stages-json``."""
    if shape.impl is None:  # pragma: no cover - _install_shape configures it
        raise RuntimeError("DlrmShape is not configured")
    cfg = shape.impl.config
    stages = [_stats.StageStats(s.name, s.start_s, s.end_s, s.users, s.settle_s, s.slo)
              for s in shape.impl.stages]
    recorder = _stats.StageRecorder(stages, clock=shape.get_run_time)

    def on_request(response_time: float, context: dict | None = None,
                   exception: BaseException | None = None, **_kw: Any) -> None:
        n = int((context or {}).get("instances", 0))
        recorder.record(float(response_time), exception is None, n,
                        None if exception is None else str(exception))

    def write(**_kw: Any) -> None:
        if not opts.dlrm_stages_json:
            return
        doc = {
            "shape": cfg.to_json(),
            "started_at_epoch": time.time() - shape.get_run_time(),
            "traffic": {
                "profile": traffic_cfg.profile.name, "format": traffic_cfg.body_format,
                "form": traffic_cfg.form,
                "context_features": list(traffic_cfg.shared_features)
                if traffic_cfg.form == "context" else [],
                "instances": traffic_cfg.instances.spec(),
                "single_fraction": traffic_cfg.instances.single_fraction,
                "expected_mean_instances": round(traffic_cfg.instances.expected_mean, 2),
                "pool_size": len(pool), "pool_mean_instances": round(pool.mean_instances, 2),
                "pool_mean_body_bytes": pool.total_bytes // len(pool),
                "zipf_alpha": traffic_cfg.zipf_alpha, "model": opts.dlrm_model,
            },
            "stages": [s.to_json() for s in recorder.stages],
        }
        path = Path(opts.dlrm_stages_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    environment.events.request.add_listener(on_request)
    environment.events.test_stop.add_listener(write)
    environment.events.quitting.add_listener(write)


@events.init.add_listener
def _on_init(environment: Any, runner: Any = None, **_: Any) -> None:
    global _RUN
    opts = environment.parsed_options
    if opts is None or not hasattr(opts, "dlrm_shape"):
        return  # used as a library: the caller wires its own shape and pool
    if opts.dlrm_stages_json and not opts.dlrm_shape:
        raise ConfigError("--dlrm-stages-json records the stages of a shape: add "
                          f"--dlrm-shape ({', '.join(_plan.SHAPES)})")
    shape = _install_shape(environment, runner, opts) if opts.dlrm_shape else None
    traffic_cfg = _traffic_config(opts)
    pool = _build_pool(traffic_cfg)
    DlrmUser.model = opts.dlrm_model
    DlrmUser.wait_time = constant(opts.dlrm_think_ms / 1000.0)
    _RUN = _Run(pool)
    if shape is not None:
        _record_stages(environment, shape, traffic_cfg, pool, opts)
    # gevent's timers count from the loop's cached clock, which stood still while this
    # blocked (building the pool takes a second or more): without a refresh, locust's
    # -t/--run-time timer would fire that much early.
    gevent.get_hub().loop.update_now()
