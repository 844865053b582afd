"""What the sidecar's routes share: one :class:`SidecarState`, injected as a dependency.

``create_app`` builds it and puts it on ``app.state.sidecar``; the app's lifespan
connects it to TorchServe (:meth:`SidecarState.connect`). Routes declare a parameter
``state: StateDep`` and FastAPI passes it; nothing is captured in closures, so a test can
build a state with a fake client and a fresh registry, or read it after requests.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from serve.metrics import HandlerAggregateCollector, SidecarMetrics
from serve.sidecar.config import SidecarConfig
from serve.sidecar.switch import VersionSwitch
from serve.sidecar.torchserve import TorchServeClient

__all__ = ["SidecarState", "StateDep", "get_state"]


@dataclass
class SidecarState:
    """The sidecar's shared state.

    Args:
        config: see :class:`~serve.sidecar.config.SidecarConfig`.
        registry: what GET /metrics exposes; ``metrics`` (and ``handler_metrics``) are
            registered in it by :meth:`create`.
        metrics: the sidecar's own metrics.
        handler_metrics: the workers' metrics from the multiprocess dir, if configured.
        clock: monotonic seconds, for durations and deadlines.
        update_lock: held while a PUT /batching runs (a second one gets 409).
        running: switches in progress (kept referenced until they end).
    """

    config: SidecarConfig
    registry: CollectorRegistry
    metrics: SidecarMetrics
    handler_metrics: HandlerAggregateCollector | None = None
    clock: Callable[[], float] = time.monotonic
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: set[asyncio.Task[Any]] = field(default_factory=set)
    _torchserve: TorchServeClient | None = field(default=None, repr=False)
    _switch: VersionSwitch | None = field(default=None, repr=False)

    @classmethod
    def create(cls, config: SidecarConfig, *, registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.monotonic) -> SidecarState:
        """A state with fresh metrics registered in ``registry`` (default: a new one,
        never the global registry, so apps don't collide)."""
        registry = registry if registry is not None else CollectorRegistry()
        metrics = SidecarMetrics()
        registry.register(metrics)
        handler_metrics = None
        if config.multiproc_dir is not None:
            handler_metrics = HandlerAggregateCollector(config.multiproc_dir)
            registry.register(handler_metrics)
        return cls(config=config, registry=registry, metrics=metrics,
                   handler_metrics=handler_metrics, clock=clock)

    def connect(self, client: httpx.AsyncClient) -> None:
        """Talk to TorchServe through ``client`` (called by the app's lifespan)."""
        self._torchserve = TorchServeClient(self.config, client)
        self._switch = VersionSwitch(
            self._torchserve, self.config, clock=self.clock,
            on_phase=self.metrics.set_switch_phase,
            forget_workers=self.handler_metrics.forget if self.handler_metrics else None)
        self.metrics.set_switch_phase(self._switch.phase.value)

    @property
    def torchserve(self) -> TorchServeClient:
        """The TorchServe client; only while the app runs."""
        if self._torchserve is None:
            raise RuntimeError("the sidecar is not connected to TorchServe; run the app "
                               "with its lifespan (uvicorn, TestClient as a context manager)")
        return self._torchserve

    @property
    def switch(self) -> VersionSwitch:
        """The version switch behind PUT /batching; only while the app runs."""
        if self._switch is None:
            raise RuntimeError("the sidecar is not connected to TorchServe; run the app "
                               "with its lifespan (uvicorn, TestClient as a context manager)")
        return self._switch


def get_state(request: Request) -> SidecarState:
    """FastAPI dependency: the app's :class:`SidecarState`."""
    state = getattr(request.app.state, "sidecar", None)
    if isinstance(state, SidecarState):
        return state
    raise RuntimeError("app.state.sidecar is not set; build the app with create_app")


#: Route parameter type: ``async def route(state: StateDep)``.
StateDep = Annotated[SidecarState, Depends(get_state)]
