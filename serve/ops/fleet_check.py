"""The fleet's rollout end to end (``make fleet-check``; long: not part of ``make test``).

1. a local fleet (:mod:`serve.ops.fleet`; started here unless ``.run/fleet.json`` lists
   pods that answer, and stopped again if started here);
2. a canary of the newest ``*-shuffled`` version of ``model_store/`` (a model trained on
   permuted labels: its scores drift, the score-PSI guard must breach) declared with PUT
   /state on one pod, under load on every pod (:class:`serve.ops.loadgen.BackgroundLoad`);
3. every pod's GET /state must show ``rollout.phase == rolled_back`` with the same
   ``revision`` within 60 s of the candidate serving (one decision, by the leader);
4. one sidecar is killed (SIGKILL) and started again: it must stay rolled back (or, once the
   leader settled the state file, serve the stable version with no rollout) and its
   TorchServe must never register the candidate again;
5. 0 failed requests over the whole run.

Prints a table and writes ``bench/results/fleet_check.json``. Exit 0 when every check
passes, 1 when one fails, 2 when it cannot run (no ``*-shuffled`` version: build one with
``make model LABEL_SHUFFLE=1``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from serve.errors import ConfigError, UpstreamUnavailable
from serve.ops.fleet import (
    FleetPlan,
    pod_config,
    pod_pids,
    restart_sidecar,
    start_fleet,
    stop_fleet,
)
from serve.ops.launch_config import REPO
from serve.ops.loadgen import BackgroundLoad
from serve.sidecar.adapters.fleet_store import Peer, read_fleet_file
from serve.state import Batching, DesiredState, ModelRef, load_state, write_state
from serve.store.repository import ModelRepository

__all__ = ["main", "newest_shuffled"]

log = logging.getLogger(__name__)
RESULT = REPO / "bench" / "results" / "fleet_check.json"
#: Every pod agrees on the rollback within this long after the candidate serves.
DECISION_WITHIN_S = 60.0


def newest_shuffled(store: Path) -> str | None:
    """The newest ``*-shuffled`` version of ``store`` (a bad candidate); None: none."""
    versions = [v for v in ModelRepository([store]).versions() if v.endswith("-shuffled")]
    return versions[-1] if versions else None


def _state(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/state", timeout=5.0)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _registered(management_url: str) -> list[str]:
    r = httpx.get(f"{management_url}/models/dlrm/all", timeout=5.0)
    if r.status_code == 404:
        return []
    r.raise_for_status()
    return [str(m.get("modelVersion")) for m in r.json()]


def _bodies(n: int = 4) -> list[bytes]:
    from serve.api.json_body import example_request

    return [json.dumps(example_request(4, seed=s)).encode() for s in range(n)]


def run_check(plan: FleetPlan, *, candidate: str, weight: float, clients: int,
              timeout_s: float) -> dict[str, Any]:
    """Steps 2-5 of the module docstring on a running fleet; the result as JSON data."""
    pods = read_fleet_file(plan.fleet_file)
    token = (plan.path(plan.run_dir) / "sidecar-token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    declared = load_state(plan.path(plan.state_file))
    stable = declared.model.version
    body = declared.model_dump(mode="json")
    # A new rollout each run: a decided one is never baked again (its decision is
    # recorded), so each run is another attempt; the bake is long enough never to end
    # before the guards decide.
    body["rollout"] = {"candidate": candidate, "mode": "canary", "weight": weight,
                       "bake_s": 600, "attempt": int(time.time()) % 1_000_000 + 1,
                       "guards": {"interval_s": 5, "min_requests": 50, "min_instances": 200}}
    loads = [BackgroundLoad(p.predict_url, _bodies(), clients=clients, timeout_s=60.0)
             for p in pods]
    result: dict[str, Any] = {"pods": len(pods), "stable": stable, "candidate": candidate,
                              "weight": weight, "state": _declared(declared, pods[0]),
                              "checks": {}}
    for load in loads:
        load.start()
    try:
        write = pods[0].write_url or pods[0].sidecar_url
        r = httpx.put(f"{write}/state", json=body, headers=auth, timeout=30.0)
        if r.status_code >= 300:
            raise UpstreamUnavailable(f"PUT /state answered {r.status_code}: {r.text[:300]}")
        views, serving_at, decided = _wait_decision(pods, timeout_s)
        agree = all(v.get("phase") == "rolled_back" for v in views.values()) and len(
            {v.get("revision") for v in views.values()}) == 1
        within = serving_at is not None and decided - serving_at <= DECISION_WITHIN_S
        result["decision"] = {name: {k: v.get(k) for k in ("phase", "revision", "decided_by",
                                                           "reason")}
                              for name, v in views.items()}
        result["decision_s_after_serving"] = (round(decided - serving_at, 1)
                                              if serving_at is not None else None)
        result["checks"]["every pod rolled back, one revision"] = agree
        result["checks"][f"decided within {DECISION_WITHIN_S:.0f} s of serving"] = within

        result["restarted"], stays, seen = _kill_and_restart(plan, pods, stable)
        result["checks"]["restarted pod stays rolled back"] = stays
        result["checks"]["candidate never registered after restart"] = not any(
            candidate in v for v in seen)
    finally:
        for load in loads:
            load.stop()
    result["requests"] = {"served": sum(lo.served for lo in loads),
                          "failed": sum(lo.failed for lo in loads),
                          "failures": [f for lo in loads for f in lo.failures[:3]]}
    result["checks"]["0 failed requests"] = result["requests"]["failed"] == 0
    lease = plan.path(plan.run_dir) / "rollout-lease.json"
    if lease.is_file():
        result["lease"] = json.loads(lease.read_text())
    result["ok"] = all(result["checks"].values())
    return result


def _wait_decision(pods: list[Peer], timeout_s: float
                   ) -> tuple[dict[str, Any], float | None, float]:
    """Poll every pod's GET /state until each shows the rollout rolled back with one
    revision (or ``timeout_s``): (the pods' rollout views, when the candidate first
    served, when they agreed or the wait ended; monotonic s)."""
    t0 = time.monotonic()
    serving_at: float | None = None
    views: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        views = {p.name: (_state(p.sidecar_url).get("rollout") or {}) for p in pods}
        if serving_at is None and any(v.get("serving") or v.get("phase") == "rolled_back"
                                      for v in views.values()):
            serving_at = time.monotonic()
        revisions = {v.get("revision") for v in views.values()}
        if all(v.get("phase") == "rolled_back" for v in views.values()) \
                and len(revisions) == 1 and None not in revisions:
            break
        time.sleep(1.0)
    return views, serving_at, time.monotonic()


def _kill_and_restart(plan: FleetPlan, pods: list[Peer], stable: str
                      ) -> tuple[dict[str, Any], bool, set[str]]:
    """SIGKILL the second pod's sidecar, start it again, watch 20 of its passes: (what was
    done, whether it stayed rolled back, the versions its TorchServe registered)."""
    victim_index = 1 if len(pods) > 1 else 0
    victim = pods[victim_index]
    cfg = pod_config(FleetPlan(**{**plan.__dict__, "pods": len(pods)}), victim_index)
    deadline = time.monotonic() + 120  # the pair unloaded first: what follows is the restart's
    while time.monotonic() < deadline:
        st = _state(victim.sidecar_url)
        if st.get("converged") and not (st.get("observed") or {}).get("candidate"):
            break
        time.sleep(1.0)
    pid = pod_pids(cfg).get("sidecar")
    if pid:
        os.kill(pid, signal.SIGKILL)
    proc = restart_sidecar(cfg)
    deadline = time.monotonic() + 120
    while not _answers(victim.sidecar_url) and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UpstreamUnavailable(f"the restarted sidecar of {victim.name} exited "
                                      f"with {proc.returncode}")
        time.sleep(0.5)
    seen: set[str] = set()
    stays = True
    for _ in range(20):  # 20 passes of the restarted reconciler (1 s each)
        seen.update(_registered(cfg.management_url))
        st = _state(victim.sidecar_url)
        ro = st.get("rollout") or {}
        desired = st.get("desired") or {}
        stays &= ro.get("phase") == "rolled_back" or (
            not ro and not desired.get("rollout")
            and (desired.get("model") or {}).get("version") == stable)
        time.sleep(1.0)
    done = {"pod": victim.name, "killed_pid": pid, "registered_after_restart": sorted(seen)}
    return done, stays, seen


def _declare_stable(plan: FleetPlan) -> None:
    """Without a declared state: the newest version that is not ``*-shuffled`` (the
    repository's latest may be the bad candidate itself), ``plan.workers`` workers."""
    path = plan.path(plan.state_file)
    if path.exists():
        return
    repo = ModelRepository([plan.path(plan.model_store)])
    good = [v for v in repo.versions() if not v.endswith("-shuffled")]
    if not good:
        raise ConfigError(f"no version but *-shuffled ones in {plan.model_store}/")
    report = repo.report(good[-1])
    batch, delay = report.get("mar_batch_size"), report.get("mar_max_batch_delay_ms")
    write_state(path, DesiredState(
        model=ModelRef(version=good[-1]),
        batching=Batching(batch_size=batch if isinstance(batch, int) else 2,
                          max_batch_delay_ms=delay if isinstance(delay, int) else 2),
        workers=plan.workers))


def _declared(declared: Any, pod: Peer) -> dict[str, Any]:
    """The serving state the check measures: the declared batching and workers, and
    whether the batching tuner runs (GET /tuner of the first pod; each pod runs its own)."""
    try:
        tuner = httpx.get(f"{pod.sidecar_url}/tuner", timeout=5).json().get("enabled")
    except (httpx.HTTPError, ValueError):
        tuner = None
    return {"batching": declared.batching.model_dump(mode="json"),
            "workers": declared.workers,
            "tuner": {True: "on", False: "off"}.get(tuner, "unknown")}


def _table(result: dict[str, Any]) -> str:
    st = result.get("state") or {}
    b = st.get("batching") or {}
    lines = [(f"fleet check: {result['pods']} pods, canary {result['candidate']} beside "
             f"{result['stable']} at weight {result['weight']}; batching "
             f"{b.get('batch_size')}/{b.get('max_batch_delay_ms')} ms, "
             f"{st.get('workers')} workers per pod, tuner {st.get('tuner')}")]
    for name, d in (result.get("decision") or {}).items():
        lines.append(f"  {name:8s} {d.get('phase')!s:12s} {d.get('revision')!s:28s} "
                     f"by {d.get('decided_by')}")
    req = result.get("requests", {})
    lines.append(f"  requests: {req.get('served')} served, {req.get('failed')} failed; "
                 f"decision {result.get('decision_s_after_serving')} s after serving")
    for check, ok in result["checks"].items():
        lines.append(f"  [{'PASS' if ok else 'FAIL'}] {check}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.fleet_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--weight", type=float, default=0.5, help="the canary's share")
    ap.add_argument("--clients", type=int, default=2, help="load clients per pod")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds for the candidate to load and the fleet to decide")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--model-store", default="model_store",
                    help="the model repository (read only): the stable version and the "
                         "*-shuffled candidate come from it")
    ap.add_argument("--workers", type=int, default=1,
                    help="workers per pod when the declared state is created")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    plan = FleetPlan(pods=args.pods, workers=args.workers,
                     model_store=Path(args.model_store))
    candidate = newest_shuffled(plan.path(plan.model_store))
    if candidate is None:
        print(f"no *-shuffled version in {plan.model_store}/: build a bad candidate with "
              "`make model LABEL_SHUFFLE=1`, then run make fleet-check again",
              file=sys.stderr)
        return 2
    started = False
    try:
        _declare_stable(plan)
        pods = read_fleet_file(plan.fleet_file)
        if not pods or not all(_answers(p.sidecar_url) for p in pods):
            start_fleet(plan, say=lambda line: print(line, flush=True))
            started = True
        result = run_check(plan, candidate=candidate, weight=args.weight,
                           clients=args.clients, timeout_s=args.timeout)
    except (ConfigError, UpstreamUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            stop_fleet(plan, say=lambda line: print(line, flush=True))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(_table(result))
    print(f"wrote {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
