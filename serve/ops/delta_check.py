"""Freshness end to end: a later day's AUC on the live service before and after its
embedding delta, the delta applied under load with nothing failed.

With ``make up`` running and a delta built by ``make delta DAY=1`` (or ``make delta-check``,
which runs both)::

    python -m serve.ops.delta_check --delta build/small-s0/deltas/small-int8-s0/00000001/dlrm-small-int8-s0-00000001.delta

Steps:

1. ``python -m serve.ops.evaluate``'s measurement of day ``--day``'s held-out rows on the
   inference API: the AUC before;
2. ``--clients`` closed-loop clients send ``--instances``-instance requests the whole
   time while the delta goes to ``POST /embeddings/deltas`` (bearer token); the POST
   waits until every worker applied it; the load runs on for ``--after-s`` seconds;
3. the AUC after, the same way.

Before any of it, the delta's ``parent_digest`` is checked against the pod's
``head_digest`` (``GET /embeddings/deltas``): a delta built on another chain than the one
the pod holds (the pod would answer 409 ``parent_mismatch``) is a bad setup, exit 2,
naming both digests.

Pass: 0 failed requests, the POST answered 200 (applied by every worker), and the AUC
rose by at least ``--min-gain`` (0.01). Prints a table and writes JSON
(``bench/results/delta_check.json``): the AUCs, the delta's rows and bytes, the apply
time per worker, requests served and failed. Exit 1 on a failed check, 2 on a bad setup.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from serve.api.binary import example_binary
from serve.api.request import BINARY_MEDIA_TYPE
from serve.constants import DEFAULT_SIDECAR_WRITE_PORT
from serve.errors import ServeError
from serve.ops.evaluate import predict_url
from serve.ops.loadgen import BackgroundLoad
from serve.ops.machine import announce
from serve.ops.state_client import describe_served, served_state
from serve.profiles import PROFILES, get_profile
from serve.store.deltas.format import DELTA_MEDIA_TYPE, Delta, decode_delta

__all__ = ["check_parent", "main", "run_check"]

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "results" / "delta_check.json"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.delta_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--delta", required=True, help="the delta file (make delta prints its path)")
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="inference endpoint")
    ap.add_argument("--sidecar", default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}",
                    help="the sidecar's write API (--write-port)")
    ap.add_argument("--token-file", default=str(REPO / ".run" / "sidecar-token"),
                    help="the sidecar's bearer token (make up writes .run/sidecar-token)")
    ap.add_argument("--day", type=int, default=None,
                    help="held-out day to measure (default: the delta's training day, from "
                         "its done.json beside it, else 1)")
    ap.add_argument("--profile", default="small", help=f"profile ({', '.join(PROFILES)})")
    ap.add_argument("--clients", type=int, default=8, help="load clients (default 8)")
    ap.add_argument("--instances", type=int, default=512,
                    help="instances per load request (default 512)")
    ap.add_argument("--after-s", type=float, default=10.0,
                    help="seconds of load after the POST answered (default 10)")
    ap.add_argument("--min-gain", type=float, default=0.01, help="AUC gain required (0.01)")
    ap.add_argument("--json", default=str(OUT), help=f"output (default {OUT})")
    return ap


def _auc(url: str, day: int, profile: str) -> dict[str, Any]:
    from serve.model.data import ensure_day_data
    from serve.ops.evaluate import evaluate

    data = ensure_day_data(get_profile(profile), day)
    return evaluate(url, data, progress=False)


def check_parent(delta: Delta, status: dict[str, Any]) -> str | None:
    """Why the pod whose ``GET /embeddings/deltas`` answer is ``status`` would refuse
    ``delta`` for its parent, or None when it builds on the pod's head (or the pod does
    not say: an older sidecar, deltas off; the POST then tells)."""
    held = status.get("versions", {}).get(delta.base_version)
    if not held or held.get("head_digest") is None:
        return None
    if delta.parent_digest is None:
        if delta.sequence == 1:
            return None
        return (f"delta {delta.sequence} of {delta.base_version} names no parent_digest "
                f"(built before deltas named their parent): rebuild it with `make delta`")
    if delta.sequence != int(held.get("last_sequence", 0)) + 1:
        return None  # a repeat or a gap: the POST answers it (200 unchanged, or 409)
    if delta.parent_digest != held["head_digest"]:
        return (f"delta {delta.sequence} of {delta.base_version} builds on parent "
                f"{delta.parent_digest}, but the pod holds {held['head_digest']} (sequence "
                f"{held.get('last_sequence')}): it belongs to another chain of deltas; "
                f"build it from the deltas the pod holds")
    return None


class SetupError(Exception):
    """The check cannot run as set up (exit 2): the message says why."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        res = run_check(args)
    except SetupError as e:
        print(f"delta_check: {e}", file=sys.stderr)
        return 2
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"checks: {res['checks']} -> {'ok' if res['ok'] else 'FAILED'}; wrote {args.json}")
    return 0 if res["ok"] else 1


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """The whole check (module docstring) with ``args`` as :func:`_parser` makes them;
    returns the result (what ``--json`` gets) after printing its table.

    Raises:
        SetupError: the delta, the token or the pod's chain make the check meaningless.
    """
    try:
        blob = Path(args.delta).read_bytes()
        delta = decode_delta(blob)
        token = Path(args.token_file).read_text().strip()
        predict = predict_url(args.url, "dlrm")
    except (OSError, ServeError) as e:
        raise SetupError(str(getattr(e, "message", e))) from e
    try:
        status = httpx.get(f"{args.sidecar}/embeddings/deltas", timeout=30, trust_env=False,
                           headers={"Authorization": f"Bearer {token}"})
        why = check_parent(delta, status.json()) if status.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        raise SetupError(f"GET {args.sidecar}/embeddings/deltas failed: {e}") from e
    if why is not None:
        raise SetupError(why)
    day = args.day
    if day is None:
        done = Path(args.delta).with_name("done.json")
        day = int(json.loads(done.read_text()).get("day", 1)) if done.is_file() else 1
    machine = announce()
    # the state measured, declared beside the figures (the load runs on whatever it is)
    served = served_state(args.sidecar)
    print(f"served: {describe_served(served)}", flush=True)
    print(f"delta {args.delta}: version {delta.base_version} #{delta.sequence}, "
          f"{delta.rows:,} rows, {len(blob):,} bytes; measuring day {day}", flush=True)
    before = _auc(predict, day, args.profile)
    print(f"  AUC before: {before['auc']:.4f} ({before['rows']:,} rows)", flush=True)
    bodies = [example_binary(args.instances, seed=s) for s in range(16)]
    with BackgroundLoad(predict, bodies, clients=args.clients,
                        content_type=BINARY_MEDIA_TYPE) as load:
        load.wait_for(2 * args.clients)
        at_post = load.served
        t0 = time.perf_counter()
        r = httpx.post(f"{args.sidecar}/embeddings/deltas", content=blob, timeout=300,
                       params={"wait_s": 120}, trust_env=False,
                       headers={"Authorization": f"Bearer {token}",
                                "Content-Type": DELTA_MEDIA_TYPE})
        post_s = time.perf_counter() - t0
        time.sleep(args.after_s)
    answer = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    print(f"  POST /embeddings/deltas: {r.status_code} in {post_s:.2f} s; load "
          f"{args.clients} clients x {args.instances}: served {load.served} "
          f"({load.served - at_post} from the POST on), failed {load.failed}", flush=True)
    after = _auc(predict, day, args.profile)
    gain = after["auc"] - before["auc"]
    workers = answer.get("workers", [])
    checks = {"post_applied": r.status_code == 200 and bool(answer.get("applied")),
              "no_failed_requests": load.failed == 0 and load.served > 0,
              "auc_gain": gain >= args.min_gain}
    if r.status_code != 200 and answer.get("message"):
        print(f"  POST answer: {answer['message']}", flush=True)
    res = {"version": delta.base_version, "sequence": delta.sequence, "day": day,
           "parent_digest": delta.parent_digest,
           "delta_rows": delta.rows, "delta_assigned": delta.assigned,
           "delta_evicted": delta.evicted, "delta_bytes": len(blob), "auc_before": before["auc"],
           "auc_after": after["auc"], "auc_gain": round(gain, 6), "eval_rows": after["rows"],
           "post_status": r.status_code, "post_seconds": round(post_s, 3),
           "apply_seconds_per_worker": {str(w["pid"]): w["apply_seconds"] for w in workers},
           "load": {"clients": args.clients, "instances": args.instances,
                    "served": load.served, "failed": load.failed},
           "state": served, "machine": machine, "checks": checks, "ok": all(checks.values())}
    print(f"| AUC day {day} before | after | gain | delta rows | delta bytes | apply s per "
          "worker | served | failed |")
    apply_s = ", ".join(f"{w['apply_seconds']:.3f}" for w in workers)
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {before['auc']:.4f} | {after['auc']:.4f} | {gain:+.4f} | {delta.rows:,} | "
          f"{len(blob):,} | {apply_s} | "
          f"{load.served} | {load.failed} |")
    return res


if __name__ == "__main__":
    sys.exit(main())
