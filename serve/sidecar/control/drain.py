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

A drain that began is recorded in a pod-local file (``marker``: ``--drain-file``, by
default ``<delta dir>/.drained.json``, an emptyDir that outlives a container restart but
not the pod), written durably before step 1. A sidecar restarted in a draining pod (its
container killed by a probe, an OOM) reads it and stays drained: ``/readyz`` 503, the
reconciler paused from the start (it would otherwise make the desired version default
again and re-open serving), and ``POST /drain`` answers the recorded report.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from serve.common.durable import temp_beside, write_durably
from serve.errors import ServeError, UpstreamUnavailable
from serve.phases import DrainPhase
from serve.sidecar.adapters.archives import POD_HANDLER
from serve.sidecar.adapters.torchserve import BatchingState, TorchServeClient, observe
from serve.sidecar.config import SidecarConfig
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
    fd, tmp = temp_beside(dst)  # never a predictable name: the store is shared
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(out, "w") as z:
            z.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest, indent=2))
            z.writestr("model-config.yaml", yaml.safe_dump(config))
            z.write(handler_file, handler_file.name)
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
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

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DrainReport:
        """The report :meth:`to_json` wrote (a drain cut short by the restart reads as
        ``failed``: what it reached is unknown)."""
        phase = DrainPhase(raw.get("phase", DrainPhase.FAILED.value))
        drained = bool(raw.get("drained"))
        if not drained and phase is not DrainPhase.FAILED:
            phase = DrainPhase.FAILED
        return cls(drained=drained, phase=phase, seconds=raw.get("seconds"),
                   versions=[str(v) for v in raw.get("versions") or []],
                   error=raw.get("error") or (None if drained else
                                              "the sidecar restarted during the drain"))


class Drainer:
    """Drains the model for shutdown (see the module docstring).

    Args:
        torchserve: the management API client.
        config: model name and store, timeouts, ``switch_grace_s``.
        switch: the version switch (its register / wait_ready / set_default / drain steps).
        reconciler: paused first; None when the sidecar runs without a state file.
        clock: monotonic seconds.
        marker: the pod-local file a drain is recorded in (module docstring); None: not
            recorded. When it exists the drainer starts drained and pauses ``reconciler``
            at once (before its loop runs).
    """

    def __init__(self, torchserve: TorchServeClient, config: SidecarConfig, *,
                 switch: VersionSwitch, reconciler: Reconciler | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 marker: Path | None = None) -> None:
        self.ts, self.config, self.switch = torchserve, config, switch
        self.reconciler = reconciler
        self.clock = clock
        self.marker = marker
        self.report = DrainReport()
        self._task: asyncio.Task[DrainReport] | None = None
        self.restored = self._restore()

    def _restore(self) -> bool:
        """Read the marker left by a drain before a restart; True when there was one."""
        if self.marker is None:
            return False
        try:
            raw = json.loads(self.marker.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:  # damaged: a drain began, that much is known
            _log.error("drain marker %s unreadable (%s): staying drained", self.marker, e)
            raw = {}
        self.report = DrainReport.from_json(raw if isinstance(raw, dict) else {})
        if self.reconciler is not None:  # its loop has not started: no pass to wait for
            self.reconciler.paused = ("the pod was drained for shutdown before the sidecar "
                                      f"restarted ({self.marker})")
        _log.warning("drain recorded in %s before this restart (%s): the pod stays drained",
                     self.marker, self.report.phase.value)
        return True

    def _record(self) -> None:
        """Write the report into the marker (durably: it must survive a crash)."""
        if self.marker is None:
            return
        try:
            write_durably(self.marker, json.dumps(self.report.to_json()).encode())
        except OSError as e:
            _log.error("drain not recorded in %s (%s): a restarted sidecar would re-open "
                       "serving", self.marker, e)

    @property
    def draining(self) -> bool:
        """A drain has begun, here or before a restart (the pod must not be ready)."""
        return self._task is not None or self.restored

    async def drain(self) -> DrainReport:
        """Close and drain; a second call waits for the first one's report (after a
        restart: the recorded one)."""
        if self.restored and self._task is None:
            return self.report
        if self._task is None:
            self._task = asyncio.create_task(self._drain())
        return await asyncio.shield(self._task)

    async def _drain(self) -> DrainReport:
        t0 = self.clock()
        report = self.report
        await asyncio.to_thread(self._record)
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
        await asyncio.to_thread(self._record)
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
