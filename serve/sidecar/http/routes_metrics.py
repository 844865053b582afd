"""``GET /metrics``: one Prometheus exposition for the whole pod.

The workers' handler metrics (multiprocess directory), the sidecar's own metrics,
``dlrm_workers`` from the management API and TorchServe's own metrics scraped from its
metrics port, re-exposed under ``ts_``, their ``model_version`` label the model version a
registration serves (:func:`ts_model_version`), not the serving version: a batching switch
registers a new serving version, and TorchServe keeps each one's series. If TorchServe is
down the rest is still served and ``dlrm_upstream_up`` says so.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from serve.metrics.aggregate import torchserve_families, workers_family
from serve.sidecar.root import SidecarDep
from serve.state import parse_serving_version

__all__ = ["router", "ts_model_version"]

_log = logging.getLogger(__name__)

router = APIRouter()


def ts_model_version(name: str) -> str:
    """A TorchServe registration's version -> the model version it serves (the stable
    one; a rollout's candidate shares its registration): ``small-s0_b8d5w2`` and
    ``small-s0_b2d2w2_csmall-s7`` -> ``small-s0``. Other names unchanged."""
    parsed = parse_serving_version(name)
    return parsed[0] if parsed is not None else name


class _Families:
    """A collector yielding fixed families (built per scrape)."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


@router.get("/metrics", summary="Prometheus exposition", response_class=Response)
async def metrics(sidecar: SidecarDep) -> Response:
    ts = sidecar.torchserve
    text_res, all_res = await asyncio.gather(
        ts.metrics_text(), ts.describe_all(), return_exceptions=True)
    extra = CollectorRegistry()
    sidecar.metrics.set_up("management", not isinstance(all_res, BaseException))
    if not isinstance(all_res, BaseException):
        workers = [w for d in all_res for w in d.get("workers") or []]
        if sidecar.handler_metrics is not None:
            sidecar.handler_metrics.reap(int(w["pid"]) for w in workers if w.get("pid"))
        extra.register(_Families([workers_family(str(w.get("status")) for w in workers)]))
    ts_ok = False
    if not isinstance(text_res, BaseException):
        try:
            extra.register(_Families(torchserve_families(text_res, version_of=ts_model_version)))
            ts_ok = True
        except ValueError as e:
            _log.warning("TorchServe metrics are not Prometheus text: %s", e)
    sidecar.metrics.set_up("metrics", ts_ok)
    registry = sidecar.registry
    body = await asyncio.to_thread(
        lambda: generate_latest(registry) + generate_latest(extra))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
