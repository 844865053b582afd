"""Drain this pod (or `make run`'s service) before its TorchServe is stopped.

    python -m serve.ops.drain [--sidecar-url URL] [--settle-s 5] [--timeout-s 120]
    python -m serve.ops.drain --wait [--sidecar-url URL] [--timeout-s 135]

Asks the sidecar (``POST /drain``, :mod:`serve.sidecar.control.drain`) to refuse new requests
with a clean 503 and to wait until every accepted request is answered; returns when it
has. It is the torchserve container's ``preStop`` hook in Kubernetes: the kubelet sends
SIGTERM only after it returns, so TorchServe (which does not drain on SIGTERM itself)
stops with nothing in flight. ``--settle-s`` first waits for the endpoint removal to
reach the load balancers (requests still routed here meanwhile are answered normally).

The token: ``DLRM_SIDECAR_TOKEN``, else ``--token-file``. Exit code 0 when drained, 1
when not (the preStop hook then only logs an event; the pod stops regardless).

``--wait`` starts no drain and needs no token: it polls ``GET /drain`` (a read, on either
of the sidecar's ports) until the sidecar reports the pod drained. It is the torchserve
container's ``preStop`` in Kubernetes, while the sidecar container's own ``preStop`` drains
with the operator token, so the container that runs model code holds no token at all.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from serve.constants import DEFAULT_TOKEN_FILE
from serve.errors import UpstreamUnavailable
from serve.ops.state_client import sidecar_token
from serve.settings import DLRM_SIDECAR_TOKEN, DLRM_SIDECAR_URL

__all__ = ["main", "request_drain", "wait_drained"]


def request_drain(sidecar_url: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """``POST {sidecar_url}/drain``; the sidecar's report (``drained``, ``seconds``...).

    Raises:
        UpstreamUnavailable: the sidecar did not answer or could not drain.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.post(f"{sidecar_url.rstrip('/')}/drain", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise UpstreamUnavailable(f"the sidecar at {sidecar_url} did not answer POST /drain "
                                  f"within {timeout_s:.0f} s: {e!r}") from None
    try:
        body: dict[str, Any] = r.json()
    except ValueError:
        body = {"raw": r.text[:200]}
    if r.status_code != 200 or not body.get("drained"):
        raise UpstreamUnavailable(f"POST /drain answered {r.status_code}: {json.dumps(body)}")
    return body


def wait_drained(sidecar_url: str, timeout_s: float, *, poll_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Poll ``GET {sidecar_url}/drain`` until it reports ``drained``; the report.

    A sidecar that does not answer yet (or any more) is polled again until ``timeout_s``.

    Raises:
        UpstreamUnavailable: not drained within ``timeout_s`` (with the last answer).
    """
    deadline = clock() + timeout_s
    last = "no answer yet"
    while True:
        try:
            r = httpx.get(f"{sidecar_url.rstrip('/')}/drain", timeout=min(5.0, timeout_s))
            body: dict[str, Any] = r.json() if r.status_code == 200 else {}
            if body.get("drained"):
                return body
            last = f"{r.status_code}: {json.dumps(body)[:300] if body else r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            last = repr(e)[:200]
        if clock() >= deadline:
            raise UpstreamUnavailable(f"the sidecar at {sidecar_url} did not report the pod "
                                      f"drained within {timeout_s:.0f} s (GET /drain, last: "
                                      f"{last})")
        sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.drain",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sidecar-url", default=DLRM_SIDECAR_URL.get(),
                    help=f"the sidecar's write API to drain (default ${DLRM_SIDECAR_URL} or "
                         f"{DLRM_SIDECAR_URL.default})")
    ap.add_argument("--token-file", default=DEFAULT_TOKEN_FILE,
                    help=f"used when {DLRM_SIDECAR_TOKEN} is not set")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="seconds to wait before closing (endpoint removal propagates)")
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="longest wait for the accepted requests to be answered")
    ap.add_argument("--wait", action="store_true",
                    help="start no drain and send no token: wait until the sidecar reports "
                         "the pod drained (GET /drain); the torchserve container's preStop")
    args = ap.parse_args(argv)
    if args.settle_s > 0 and not args.wait:
        time.sleep(args.settle_s)
    try:
        if args.wait:
            report = wait_drained(args.sidecar_url, args.timeout_s)
        else:
            report = request_drain(args.sidecar_url, sidecar_token(args.token_file),
                                   args.timeout_s)
    except UpstreamUnavailable as e:
        print(f"drain failed: {e.message}", file=sys.stderr, flush=True)
        return 1
    print(f"drained in {report.get('seconds')} s (versions {report.get('versions')})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
