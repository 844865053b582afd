"""Graceful shutdown: answer every accepted request, refuse new ones cleanly, then stop.

TorchServe does not drain on SIGTERM (pytorch/serve issue 2008): the requests in flight
and queued are reset. So a pod (``preStop``: ``python -m serve.ops.drain``) and the
launcher (``make run`` on SIGTERM or Ctrl-C) first ask the sidecar to drain, and only
then signal TorchServe. :meth:`Drainer.drain`, in steps:

1. **pause** the reconciler (no switch or clean-up may start, one in progress ends first)
   and turn ``/readyz`` to 503 (Kubernetes stops routing to the pod);
2. **close**: register the *closed* version (:func:`closed_archive`, the handler
   ``handlers/closed_handler.py``: every request a JSON 503 "shutting down; retry") and
   make it the model's default: requests arriving from now on are refused cleanly, at
   once;
3. **drain** every other registered version the way a version switch does
   (:meth:`~serve.sidecar.control.switch.VersionSwitch.drain`: its queue reads empty for the grace
   time plus its batch delay): every request accepted before step 2 is answered.

After that TorchServe can be stopped: nothing it accepted is lost. Idempotent: a second
call waits for the first and returns the same report.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from serve.errors import ServeError, UpstreamUnavailable
from serve.sidecar.adapters.archives import POD_HANDLER
from serve.sidecar.adapters.torchserve import BatchingState, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
from serve.sidecar.control.phases import DrainPhase
from serve.sidecar.control.reconciler import Reconciler
from serve.sidecar.control.switch import SwitchPlan, VersionSwitch

__all__ = ["CLOSED_HANDLER", "CLOSED_VERSION", "DrainPhase", "DrainReport", "Drainer",
           "closed_archive"]

_log = logging.getLogger(__name__)

CLOSED_VERSION = "closed"
CLOSED_HANDLER = POD_HANDLER.parent / "closed_handler.py"


def closed_archive(model_store: Path, model_name: str,
                   handler_file: Path = CLOSED_HANDLER) -> Path:
    """Write ``<store>/<model>-closed.mar``: the closed handler, one worker, no model."""
    if not handler_file.is_file():
        raise UpstreamUnavailable(
            f"the closed handler {handler_file} is missing; the image must hold handlers/")
    dst = model_store / f"{model_name}-{CLOSED_VERSION}.mar"
    manifest = {"runtime": "python", "model": {
        "modelName": model_name, "handler": handler_file.name, "modelVersion": CLOSED_VERSION,
        "configFile": "model-config.yaml"}, "archiverVersion": "0.12.0"}
    config = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 8, "maxBatchDelay": 1,
              "responseTimeout": 10}
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest, indent=2))
        z.writestr("model-config.yaml", yaml.safe_dump(config))
        z.write(handler_file, handler_file.name)
    tmp.replace(dst)
    return dst


@dataclass
class DrainReport:
    """What a drain did: ``drained`` once every accepted request was answered."""

    drained: bool = False
    phase: DrainPhase = DrainPhase.SERVING
    seconds: float | None = None
    versions: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"drained": self.drained, "phase": self.phase.value, "seconds": self.seconds,
                "versions": self.versions, "error": self.error}


class Drainer:
    """Drains the model for shutdown (see the module docstring).

    Args:
        torchserve: the management API client.
        config: model name and store, timeouts, ``switch_grace_s``.
        switch: the version switch (its register / wait_ready / set_default / drain steps).
        reconciler: paused first; None when the sidecar runs without a state file.
        clock: monotonic seconds.
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 switch: VersionSwitch, reconciler: Reconciler | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ts, self.config, self.switch = torchserve, config, switch
        self.reconciler = reconciler
        self.clock = clock
        self.report = DrainReport()
        self._task: asyncio.Task[DrainReport] | None = None

    @property
    def draining(self) -> bool:
        """A drain has begun (the pod must not be ready any more)."""
        return self._task is not None

    async def drain(self) -> DrainReport:
        """Close and drain; a second call waits for the first one's report."""
        if self._task is None:
            self._task = asyncio.create_task(self._drain())
        return await asyncio.shield(self._task)

    async def _drain(self) -> DrainReport:
        t0 = self.clock()
        report = self.report
        try:
            if self.reconciler is not None:
                await self.reconciler.pause("the pod is draining for shutdown (POST /drain)")
            report.phase = DrainPhase.CLOSING
            observed = await observe(self.ts)
            old = [r for r in observed.versions if r.version != CLOSED_VERSION]
            report.versions = [r.version for r in old]
            await self.close()
            report.phase = DrainPhase.DRAINING
            for version in old:
                await self.switch.drain(version)
            report.drained, report.phase = True, DrainPhase.DRAINED
        except Exception as e:  # noqa: BLE001 - reported; the caller stops TorchServe anyway
            report.phase = DrainPhase.FAILED
            report.error = e.message if isinstance(e, ServeError) else repr(e)
            _log.error("drain failed: %s", report.error)
        report.seconds = round(self.clock() - t0, 3)
        self.switch.idle()
        _log.info("drain %s in %.1f s (versions %s)", report.phase, report.seconds,
                  report.versions)
        return report

    async def close(self) -> None:
        """Register the closed version and make it the default (new requests: 503)."""
        store, model = self.config.model_store, self.config.model_name
        dst = await asyncio.to_thread(closed_archive, store, model)
        plan = SwitchPlan(new=BatchingState(batch_size=8, max_batch_delay_ms=1, workers=1,
                                            model_version=CLOSED_VERSION), src=None, dst=dst)
        await self.switch.register(plan)
        await self.switch.wait_ready(plan)
        await self.switch.set_default(plan)
        _log.info("closed: new requests get 503 from the %r version", CLOSED_VERSION)
