"""The sidecar's composition root: :class:`Sidecar` builds every part once and hands
them to the routes as one dependency.

:meth:`Sidecar.create` builds what needs no TorchServe (metrics, the repository and its
schemas, the feedback and delta services, the GPU collector, the tuner);
:meth:`Sidecar.connect` (the app's lifespan) builds what talks to TorchServe (the client,
the version switch, the reconciler, the tuning loop, the PUT /batching updates, the
drainer) and :meth:`Sidecar.start` starts their loops. The parts hold the behaviour; this
module only wires them (which part gets which clock, registry, client and config) and
owns their tasks. Routes declare ``sidecar: SidecarDep`` and FastAPI passes it; nothing
is captured in closures, so a test can build one with a fake client and a fresh
registry, or read it after requests.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, TypeVar

import httpx
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from serve.common.signing import load_verify_key
from serve.errors import Conflict, UpstreamUnavailable
from serve.metrics import EMBEDDING_IDS_FALLBACK_TOTAL
from serve.metrics.aggregate import HandlerAggregateCollector, feature_counts
from serve.metrics.sidecar import SidecarMetrics
from serve.settings import DLRM_STATE_FILE
from serve.sidecar.adapters.archives import control_path
from serve.sidecar.adapters.fleet_store import FileDecisionStore, FileLease, FilePeers
from serve.sidecar.adapters.gpu import GpuCollector
from serve.sidecar.adapters.memory import CgroupMemory, MemoryProbe, is_memory_backed
from serve.sidecar.adapters.model_schemas import SchemaCache
from serve.sidecar.adapters.torchserve import TorchServeClient, observe
from serve.sidecar.config import DEFAULT_STATE_FILE, SidecarConfig
from serve.sidecar.control.batching import BatchingUpdates
from serve.sidecar.control.drain import Drainer
from serve.sidecar.control.fleet import Fleet, FleetFamilies
from serve.sidecar.control.reconciler import Reconciler
from serve.sidecar.control.rollout import RolloutController
from serve.sidecar.control.switch import VersionSwitch
from serve.sidecar.control.tuner import BatchTuner
from serve.sidecar.control.tuner_loop import TuningLoop
from serve.sidecar.services.deltas.cleanup import clean_versions, model_versions
from serve.sidecar.services.deltas.intake import DeltaIntake
from serve.sidecar.services.deltas.parts import DeltaParts
from serve.sidecar.services.deltas.progress import WorkerProgress
from serve.sidecar.services.deltas.report import DeltaReport
from serve.sidecar.services.deltas.volume import VolumeSync
from serve.sidecar.services.feedback import FeedbackService
from serve.sidecar.services.tiers import TierWindow
from serve.store.deltas.files import DeltaStore
from serve.store.repository import ModelRepository

_log = logging.getLogger(__name__)
#: Between two clean-ups of the delta folder when the volume sync is off (seconds).
_CLEAN_INTERVAL_S = 5.0

__all__ = ["Sidecar", "SidecarDep", "get_sidecar"]

_T = TypeVar("_T")


async def stop_task(task: asyncio.Task[Any], retry_s: float = 1.0) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again every ``retry_s``.

    A single cancel can be lost inside a task (Python 3.11's ``wait_for`` returning a
    result that raced the cancel; a ``finally`` that awaits a cancelled child and
    suppresses its CancelledError), and then a plain ``cancel(); await task`` waits
    forever (a test's app lifespan once hung with an idle event loop; which task held it
    was not found). What the task raised on its way out, other than the cancellation,
    is logged."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=retry_s)
    if not task.cancelled() and task.exception() is not None:
        _log.error("%s ended with an error", task.get_name(), exc_info=task.exception())


@dataclass
class Sidecar:
    """The sidecar's parts, wired (see the module docstring).

    Args:
        config: see :class:`~serve.sidecar.config.SidecarConfig`.
        registry: what GET /metrics exposes; ``metrics`` (and ``handler_metrics``) are
            registered in it by :meth:`create`.
        metrics: the sidecar's own metrics.
        handler_metrics: the workers' metrics from the multiprocess dir, if configured.
        clock: monotonic seconds, for durations and deadlines.
        repository: the model versions (``config.repository_roots``).
        schemas: the versions' request schemas, read once from their build reports
            (GET /state's ``observed.model.schema``, the rollout's schema check).
        feedback: the click-feedback join (POST /feedback), registered in ``registry``.
        gpu: the GPUs' utilization and memory through NVML, registered in ``registry`` by
            :meth:`create` (disabled, exporting nothing, without an NVIDIA GPU/driver).
        wall_clock: unix seconds (the age of the newest embedding delta applied).
        deltas: the embedding-delta parts (POST /embeddings/deltas), their report
            registered in ``registry``; None without ``config.delta_dir``.
        tuner: the batching tuner (:mod:`serve.sidecar.control.tuner`); it acts only with a
            desired-state file (through the reconciler).
        oip_port: the Open Inference Protocol's port (GET /state's ``endpoints``); None
            when not served.
        write_port: the port the write API listens on (GET /state's ``sidecar``); None
            when every port takes writes (one listener).
        tiers: the table tiers' recent window (GET /state's ``observed.tables``); None
            without the workers' multiprocess dir.
    """

    config: SidecarConfig
    registry: CollectorRegistry
    metrics: SidecarMetrics
    handler_metrics: HandlerAggregateCollector | None = None
    clock: Callable[[], float] = time.monotonic
    repository: ModelRepository | None = None
    schemas: SchemaCache | None = None
    feedback: FeedbackService = field(default_factory=lambda: FeedbackService(
        SidecarConfig().feedback))
    gpu: GpuCollector | None = None
    wall_clock: Callable[[], float] = time.time
    deltas: DeltaParts | None = None
    tuner: BatchTuner | None = None
    write_port: int | None = None
    oip_port: int | None = None
    tiers: TierWindow | None = None
    _tiers_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _tune_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _torchserve: TorchServeClient | None = field(default=None, repr=False)
    _switch: VersionSwitch | None = field(default=None, repr=False)
    _reconciler: Reconciler | None = field(default=None, repr=False)
    _reconcile_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _delta_sync_task: asyncio.Task[None] | None = field(default=None, repr=False)
    _drainer: Drainer | None = field(default=None, repr=False)
    _tuning: TuningLoop | None = field(default=None, repr=False)
    _batching: BatchingUpdates | None = field(default=None, repr=False)
    fleet: Fleet | None = None
    _lease_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @classmethod
    def create(cls, config: SidecarConfig, *, registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.monotonic,
               nvml: ModuleType | None = None,
               wall_clock: Callable[[], float] = time.time) -> Sidecar:
        """A state with fresh metrics registered in ``registry`` (default: a new one,
        never the global registry, so apps don't collide). ``nvml``: the NVML bindings
        for the GPU metrics (default: the real pynvml; tests pass a fake module).
        ``wall_clock``: unix seconds (default ``time.time``)."""
        registry = registry if registry is not None else CollectorRegistry()
        metrics = SidecarMetrics()
        registry.register(metrics)
        handler_metrics, tiers = None, None
        if config.multiproc_dir is not None:
            handler_metrics = HandlerAggregateCollector(config.multiproc_dir)
            registry.register(handler_metrics)
            tiers = TierWindow(handler_metrics.collect, clock=clock)
        repository = _repository(config)
        state = cls(config=config, registry=registry, metrics=metrics,
                    handler_metrics=handler_metrics, clock=clock, repository=repository,
                    schemas=SchemaCache(repository.report), wall_clock=wall_clock,
                    tiers=tiers)
        state.feedback = FeedbackService(
            config.feedback, versions=state.served_versions,
            baseline_of=lambda v: repository.report(v).get("baseline"))
        registry.register(state.feedback)
        state.tuner = BatchTuner(config.tuner, clock=clock,
                                 on_decision=lambda d: metrics.observe_tuner_decision(d.reason))
        metrics.set_tuner(state.tuner.phase, None)
        state.gpu = GpuCollector(nvml)  # one per state: its own registry
        registry.register(state.gpu)
        if config.delta_dir is not None:
            state.deltas = _delta_parts(DeltaStore(config.delta_dir), config,
                                        versions=state.served_versions,
                                        report_of=repository.report, clock=clock,
                                        wall_clock=wall_clock,
                                        fallback_counts=_fallback_counts(handler_metrics))
            registry.register(state.deltas.report)
        return state

    def rollout_families(self) -> Iterator[Metric]:
        """What a rollout's guards read: the workers' per-arm families (none without a
        multiprocess dir) and the feedback join's label sums (the click-quality gates)."""
        if self.handler_metrics is not None:
            yield from self.handler_metrics.collect()
        yield from self.feedback.quality_collect()

    def served_versions(self) -> list[str]:
        """The repository versions the desired state serves now: the stable one and a
        rollout's candidate (empty without a desired-state file)."""
        desired = self._reconciler.effective() if self._reconciler is not None else None
        if desired is None:
            return []
        out = [desired.model.version]
        if desired.rollout is not None:
            out.append(desired.rollout.candidate)
        return out

    def connect(self, client: httpx.AsyncClient) -> None:
        """Talk to TorchServe through ``client`` (called by the app's lifespan)."""
        config = self.config
        self._torchserve = TorchServeClient(config, client)
        memory = MemoryProbe(CgroupMemory(config.cgroup_root), config.memory_limit_bytes,
                             held=self._delta_held_bytes())
        self._switch = VersionSwitch(
            self._torchserve, config, clock=self.clock,
            on_phase=self.metrics.set_switch_phase, memory=memory,
            forget_workers=self.handler_metrics.forget if self.handler_metrics else None)
        self.metrics.set_switch_phase(self._switch.phase.value)
        if config.state_file is not None:
            own = self.rollout_families
            self.fleet = build_fleet(config, own)
            if self.fleet is not None:
                self.registry.register(self.fleet)
            fleet = self.fleet
            self._reconciler = Reconciler(
                self._torchserve, config, switch=self._switch, metrics=self.metrics,
                repository=self.repository or _repository(config),
                rollouts=RolloutController(
                    read_families=fleet_families(fleet, own),
                    control_file=lambda version: control_path(
                        config.model_store, config.model_name, version),
                    metrics=self.metrics, clock=self.clock,
                    decisions=fleet.decisions if fleet is not None else None,
                    identity=fleet.identity if fleet is not None else "local"),
                schemas=self.schemas, clock=self.clock, fleet=fleet)
        if self.tuner is not None:
            handler = self.handler_metrics
            self._tuning = TuningLoop(
                self.tuner, metrics=self.metrics, torchserve=self._torchserve,
                switch=self._switch, reconciler=self._reconciler,
                worker_families=handler.collect if handler is not None else None,
                clock=self.clock)
        if self._reconciler is not None:
            self._batching = BatchingUpdates(self._reconciler, torchserve=self._torchserve,
                                             metrics=self.metrics, tuning=self._tuning,
                                             clock=self.clock)
        self._drainer = Drainer(self._torchserve, config, switch=self._switch,
                                reconciler=self._reconciler, clock=self.clock,
                                marker=config.drain_marker)
        if self.deltas is not None:
            self.deltas.progress.set_live_pids(self._worker_pids)

    def _delta_held_bytes(self) -> Callable[[], int] | None:
        """What a memory-backed delta folder holds beyond the workers' RSS (for the
        switch's memory check); None when the folder is on a disk (page cache)."""
        deltas, folder = self.deltas, self.config.delta_dir
        if deltas is None or folder is None or not is_memory_backed(folder):
            return None
        return lambda: deltas.store.held_bytes(sorted(set(self.served_versions())))

    async def _worker_pids(self) -> Iterable[int]:
        """The pids of every TorchServe worker of the model now (all versions)."""
        return list((await observe(self.torchserve)).pids())

    def start(self) -> None:
        """Start the reconciler's loop (the app's lifespan; no-op without a state file),
        and the model volume's delta pickup (with a delta folder and ``delta_sync_s``)."""
        if self._reconciler is not None and self._reconcile_task is None:
            self._reconcile_task = asyncio.create_task(self._reconciler.run())
        if self.deltas is not None and self._delta_sync_task is None:
            self._delta_sync_task = asyncio.create_task(self._sync_deltas())
        if self._reconciler is not None and self._tuning is not None \
                and self._tune_task is None:
            self._tune_task = asyncio.create_task(self._tuning.run())
        if self.tiers is not None and self._tiers_task is None:
            self._tiers_task = asyncio.create_task(self.tiers.run())
        if self.fleet is not None and self.fleet.lease is not None \
                and self._lease_task is None:
            self._lease_task = asyncio.create_task(self._renew_lease())

    async def _renew_lease(self) -> None:
        """Renew the fleet's rollout lease every third of its duration, apart from the
        reconcile pass: a pass can spend minutes in a switch (registering a version), and
        a lease renewed only by the passes would expire meanwhile and change hands."""
        fleet = self.fleet
        if fleet is None:
            return
        interval = max(0.5, self.config.fleet.lease_s / 3)
        while True:
            await asyncio.to_thread(fleet.elect)  # never raises
            await asyncio.sleep(interval)

    async def _sync_deltas(self) -> None:
        """Every ``delta_sync_s`` (5 s when 0): deltas published on the model volume (the
        repository folders, only when ``delta_sync_s`` > 0), through the same checks as
        a POST, then the clean-up of versions no longer served. Never dies: errors are
        logged."""
        roots = list(self.config.delta_volume_roots)
        interval = self.config.delta_sync_s or _CLEAN_INTERVAL_S
        while True:
            try:
                if self.deltas is not None and self.config.delta_sync_s > 0:
                    await asyncio.to_thread(self.deltas.volume.sync, roots)
                await self.clean_deltas()
            except Exception:  # noqa: BLE001 - a bad volume must not stop the sidecar
                _log.exception("picking up or cleaning embedding deltas (%s) failed", roots)
            await asyncio.sleep(interval)

    async def clean_deltas(self) -> list[str]:
        """Delete the delta folders of versions neither served (desired state) nor
        registered with TorchServe, once no live worker reports in them
        (:func:`~serve.sidecar.services.deltas.cleanup.clean_versions`). Nothing is
        deleted while TorchServe does not answer (who maps what is unknown then) or
        during a drain. Returns the versions removed."""
        if self.deltas is None or self._torchserve is None or self.draining:
            return []
        try:
            observed = await observe(self._torchserve)
        except UpstreamUnavailable:
            return []
        keep = set(self.served_versions())
        for registered in observed.versions:
            keep.update(model_versions(registered.version))
        return await asyncio.to_thread(clean_versions, self.deltas.store, keep,
                                       list(observed.pids()))

    async def stop(self) -> None:
        """Stop the reconciler's loop. A switch cut short is picked up by the next start:
        each pass starts from what TorchServe describes."""
        for name in ("_reconcile_task", "_delta_sync_task", "_tune_task", "_lease_task",
                     "_tiers_task"):
            task = getattr(self, name)
            setattr(self, name, None)
            if task is not None:
                await stop_task(task)

    @property
    def torchserve(self) -> TorchServeClient:
        """The TorchServe client; only while the app runs."""
        return _connected(self._torchserve)

    @property
    def drainer(self) -> Drainer:
        """The shutdown drain (POST /drain); only while the app runs."""
        return _connected(self._drainer)

    @property
    def draining(self) -> bool:
        """A drain for shutdown has begun: the pod is not ready any more."""
        return self._drainer is not None and self._drainer.draining

    def batching_updates(self, what: str) -> BatchingUpdates:
        """PUT /batching's service, or 409 explaining that ``what`` needs a
        desired-state file; only while the app runs."""
        self.require_reconciler(what)
        return _connected(self._batching)

    @property
    def tuning(self) -> TuningLoop | None:
        """The batching tuner's loop (PUT /tuner, the pinning of a hand-set batching);
        None without a tuner or before the app runs."""
        return self._tuning

    @property
    def reconciler(self) -> Reconciler | None:
        """The reconciler; None when the sidecar runs without a desired-state file."""
        return self._reconciler

    def require_reconciler(self, what: str) -> Reconciler:
        """The reconciler, or 409 explaining that ``what`` needs a desired-state file."""
        if self._reconciler is None:
            raise Conflict(
                f"{what} changes the desired state, but this sidecar was started without "
                f"--state-file (or {DLRM_STATE_FILE}): restart it with one (in Kubernetes "
                f"the ConfigMap dlrm-serving-state mounted at {DEFAULT_STATE_FILE})")
        return self._reconciler

    @property
    def switch(self) -> VersionSwitch:
        """The version switch behind PUT /batching; only while the app runs."""
        return _connected(self._switch)


def _connected(part: _T | None) -> _T:
    """``part`` of a running app; RuntimeError while the app is not running (the parts
    that talk to TorchServe are built by its lifespan)."""
    if part is None:
        raise RuntimeError("the sidecar is not connected to TorchServe; run the app "
                           "with its lifespan (uvicorn, TestClient as a context manager)")
    return part


def fleet_families(fleet: Fleet | None, own: Callable[[], Iterable[Metric]]
                   ) -> Callable[[], Iterable[Metric]]:
    """What the rollout's guards read: the fleet's families where this pod belongs to a
    fleet (only its leader judges), else ``own`` (a wrapper: ``own`` may itself combine
    collectors)."""
    if fleet is None or fleet.families is None:
        return own
    fleet.families.own = own
    return fleet.families


def build_fleet(config: SidecarConfig, own: Callable[[], Iterable[Metric]]) -> Fleet | None:
    """The fleet of ``config.fleet`` (None for ``none`` or without a state file).

    ``file``: the lease, the decisions and ``fleet.json`` in ``fleet.run_dir`` (default:
    the state file's folder, ``.run/`` locally). ``kubernetes``: through the API server
    with the pod's service account (:mod:`serve.sidecar.adapters.kubernetes`)."""
    fc = config.fleet
    if fc.mode == "none" or config.state_file is None:
        return None
    identity = fc.identity or socket.gethostname()
    if fc.mode == "file":
        folder = fc.run_dir or Path(config.state_file).parent
        return Fleet(identity, decisions=FileDecisionStore(folder / "rollout-decisions.json"),
                     lease=FileLease(folder / "rollout-lease.json", duration_s=fc.lease_s),
                     families=FleetFamilies(own, FilePeers(folder / "fleet.json"), identity,
                                            timeout_s=fc.peer_timeout_s))
    from serve.sidecar.adapters.kubernetes import (
        ConfigMapDecisionStore,
        KubeClient,
        KubeLease,
        KubePeers,
    )

    client = KubeClient.in_cluster()
    store = ConfigMapDecisionStore(client, fc.decisions_configmap)
    return Fleet(identity, decisions=store, lease=KubeLease(client, fc.lease_name, fc.lease_s),
                 families=FleetFamilies(own, KubePeers(client, fc.peer_service), identity,
                                        timeout_s=fc.peer_timeout_s),
                 publish_state=store.publish_state, renew_every_s=fc.lease_s / 3)


def get_sidecar(request: Request) -> Sidecar:
    """FastAPI dependency: the app's :class:`Sidecar`."""
    state = getattr(request.app.state, "sidecar", None)
    if isinstance(state, Sidecar):
        return state
    raise RuntimeError("app.state.sidecar is not set; build the app with create_app")


#: Route parameter type: ``async def route(sidecar: SidecarDep)``.
SidecarDep = Annotated[Sidecar, Depends(get_sidecar)]


def _fallback_counts(handler_metrics: HandlerAggregateCollector | None
                     ) -> Callable[[], dict[str, dict[str, int]]] | None:
    """The pod's fallback-row lookups per version and feature, read from the workers'
    metric files (None without them)."""
    if handler_metrics is None:
        return None
    collector = handler_metrics
    return lambda: feature_counts(collector.collect(), EMBEDDING_IDS_FALLBACK_TOTAL)


def _repository(config: SidecarConfig) -> ModelRepository:
    """The model repository, checking archive signatures with ``--archive-verify-key``."""
    key = (None if config.archive_verify_key is None
           else load_verify_key(config.archive_verify_key))
    if key is None:
        _log.warning("model archives: each one's recorded sha256 is checked, its signature "
                     "is NOT (no --archive-verify-key): whoever can write the model "
                     "repository can publish code (SECURITY.md)")
    return ModelRepository(config.repository_roots, config.model_name, verify_key=key)


def _delta_parts(store: DeltaStore, config: SidecarConfig, *,
                 versions: Callable[[], list[str]],
                 report_of: Callable[[str], dict[str, Any]], clock: Callable[[], float],
                 wall_clock: Callable[[], float],
                 fallback_counts: Callable[[], dict[str, dict[str, int]]] | None
                 ) -> DeltaParts:
    """The embedding-delta parts around ``store``, wired: the volume sync goes through the
    intake; the report reads the intake and the workers' progress. The live pids are
    connected by :meth:`Sidecar.connect`."""
    key = (None if config.delta_verify_key is None
           else load_verify_key(config.delta_verify_key))
    intake = DeltaIntake(store, versions=versions, report_of=report_of,
                         max_bytes=config.max_delta_bytes,
                         max_store_bytes=config.max_delta_store_bytes, verify_key=key)
    if key is None:
        _log.warning("embedding delta signatures are NOT verified (no --delta-verify-key): "
                     "whoever can write the model volume's deltas/ or POST a delta can "
                     "change the served embeddings (docs/deltas.md, Signed deltas)")
    else:
        _log.info("embedding deltas must be signed by key %s (%s)", key.key_id,
                  config.delta_verify_key)
    progress = WorkerProgress(store, versions=versions, clock=clock)
    return DeltaParts(store=store, intake=intake, volume=VolumeSync(intake, versions),
                      progress=progress,
                      report=DeltaReport(intake, progress, versions=versions,
                                         report_of=report_of, wall_clock=wall_clock,
                                         fallback_counts=fallback_counts))
