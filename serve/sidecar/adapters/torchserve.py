"""The calls the sidecar makes to TorchServe, and how it reads TorchServe's answers.

TorchServe's management API is the *observed state*: which versions of the model are
registered, which is default, how many workers are READY and how many requests wait in
each version's queue (``GET /models/{m}/{v}`` -> ``jobQueueStatus.pendingRequests``).
Every failure becomes :class:`~serve.errors.UpstreamUnavailable` (503) with the URL and
TorchServe's own message; a 404 is the subclass :class:`NotRegistered`, so that steps
can treat "already gone" as done.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel

from serve.errors import UpstreamUnavailable
from serve.sidecar.config import SidecarConfig

__all__ = [
    "PREDICT_TIMEOUT_S",
    "NotRegistered",
    "Observed",
    "Registered",
    "TorchServeClient",
    "batching_state",
    "observe",
    "pending_requests",
    "ready_workers",
]


#: Longest wait for a forwarded predict (s): above the archives' ``responseTimeout``
#: (120 s), so TorchServe's own timeout answers first and names the cause.
PREDICT_TIMEOUT_S = 125.0


class NotRegistered(UpstreamUnavailable):
    """TorchServe answered 404: the model or that version of it is not registered."""


class TorchServeClient:
    """The calls the sidecar makes to TorchServe's inference, management and metrics APIs.

    Args:
        config: the URLs, the model name and the read timeout.
        client: the HTTP client (the app's; tests pass one on a fake transport).
    """

    def __init__(self, config: SidecarConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client

    async def _get(self, url: str, what: str, timeout: float | None = None) -> httpx.Response:
        try:
            return await self.client.get(
                url, timeout=timeout or self.config.upstream_timeout_s)
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(
                f"TorchServe {what} at {url} did not answer ({type(e).__name__}: {e}); "
                f"check that TorchServe is running") from None

    async def describe(self, version: str | None = None) -> dict[str, Any]:
        """The description of one version (default version when None)."""
        m = self.config.model_name
        url = f"{self.config.management_url}/models/{m}" + (f"/{version}" if version else "")
        r = await self._get(url, "management API")
        if r.status_code == 404:
            raise NotRegistered(
                f"model {m!r}" + (f" version {version}" if version else "")
                + f" is not registered in TorchServe ({url}: {_ts_message(r)})")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")
        body = r.json()
        return body[0] if isinstance(body, list) else body

    async def describe_all(self) -> list[dict[str, Any]]:
        """The descriptions of every registered version of the model; [] when none is
        (TorchServe answers 404 for a model with no version registered)."""
        url = f"{self.config.management_url}/models/{self.config.model_name}/all"
        r = await self._get(url, "management API")
        if r.status_code == 404:
            return []
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")
        return list(r.json())

    async def ping(self) -> None:
        """Raise unless the inference API's ``/ping`` answers 200."""
        url = f"{self.config.inference_url}/ping"
        r = await self._get(url, "inference API")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")

    async def predict(self, body: bytes, content_type: str,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        """``POST /predictions/{model}`` on the inference API, as any client of ours would
        send it (TorchServe batches it with the rest); the response whatever its status.

        The timeout is :data:`PREDICT_TIMEOUT_S`, not the management calls' one: a predict
        waits in TorchServe's queue and batch under load.
        """
        url = f"{self.config.inference_url}/predictions/{self.config.model_name}"
        try:
            return await self.client.post(
                url, content=body, timeout=PREDICT_TIMEOUT_S,
                headers={"Content-Type": content_type, **(headers or {})})
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(
                f"TorchServe inference API at {url} did not answer ({type(e).__name__}: "
                f"{e}); check that TorchServe is running") from None

    async def metrics_text(self) -> str:
        """TorchServe's own Prometheus exposition (its metrics port)."""
        url = f"{self.config.metrics_url}/metrics"
        r = await self._get(url, "metrics API")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}")
        return r.text

    async def call(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                   timeout: float | None = None) -> httpx.Response:
        """A write to the management API (``path`` from ``/``); raises on any status >= 300,
        :class:`NotRegistered` on 404."""
        url = f"{self.config.management_url}{path}"
        try:
            r = await self.client.request(
                method, url, params=params, timeout=timeout or self.config.upstream_timeout_s)
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(
                f"TorchServe {method} {url} failed ({type(e).__name__}: {e})") from None
        if r.status_code >= 300:
            error = NotRegistered if r.status_code == 404 else UpstreamUnavailable
            raise error(f"TorchServe {method} {url} answered {r.status_code}: {_ts_message(r)}")
        return r


def _ts_message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))[:500]
    except (ValueError, AttributeError):
        return r.text[:500]


class BatchingState(BaseModel):
    """The default version's batching settings, as TorchServe reports them.

    ``model_version`` is TorchServe's version name: for a version the sidecar registered,
    the serving version ``<repository version>_b<batch>d<delay>w<workers>``.
    """

    batch_size: int
    max_batch_delay_ms: int
    workers: int
    model_version: str




def batching_state(desc: dict[str, Any]) -> BatchingState:
    """The batching settings in one version's description."""
    return BatchingState(
        batch_size=int(desc["batchSize"]),
        max_batch_delay_ms=int(desc["maxBatchDelay"]),
        workers=len(desc.get("workers") or []),
        model_version=str(desc["modelVersion"]),
    )


def ready_workers(desc: dict[str, Any]) -> int:
    """How many of the version's workers are READY."""
    return sum(1 for w in desc.get("workers") or [] if w.get("status") == "READY")


def pending_requests(desc: dict[str, Any]) -> int | None:
    """Requests waiting in the version's job queue; None when TorchServe does not report
    ``jobQueueStatus`` (releases before 0.9). A batch a worker has already taken off the
    queue is not counted: TorchServe does not describe work in flight."""
    status = desc.get("jobQueueStatus")
    if not isinstance(status, dict) or "pendingRequests" not in status:
        return None
    return int(status["pendingRequests"])


@dataclass(frozen=True)
class Registered:
    """One registered version of the model, as TorchServe describes it.

    ``memory`` is each worker's ``memoryUsage`` in bytes as TorchServe last measured it
    (0: not yet), ``memory_by_pid`` the same for the workers that have a pid;
    ``pending`` is the queue length (None: not reported).
    """

    version: str
    batch_size: int
    max_batch_delay_ms: int
    url: str
    pids: tuple[int, ...]
    ready: int
    pending: int | None
    memory: tuple[int, ...] = ()
    memory_by_pid: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_description(cls, desc: dict[str, Any]) -> Registered:
        workers = desc.get("workers") or []
        return cls(version=str(desc["modelVersion"]), batch_size=int(desc["batchSize"]),
                   max_batch_delay_ms=int(desc["maxBatchDelay"]),
                   url=str(desc.get("modelUrl") or ""),
                   pids=tuple(int(w["pid"]) for w in workers if _positive(w.get("pid"))),
                   ready=ready_workers(desc), pending=pending_requests(desc),
                   memory=tuple(int(w.get("memoryUsage") or 0) for w in workers),
                   # Paired per worker: a worker without a pid yet has a memory entry but
                   # no pid, so zipping ``pids`` with ``memory`` would shift the pairs.
                   memory_by_pid=tuple((int(w["pid"]), int(w.get("memoryUsage") or 0))
                                       for w in workers if _positive(w.get("pid"))))

    @property
    def workers(self) -> int:
        return len(self.memory)

    def batching(self) -> BatchingState:
        return BatchingState(batch_size=self.batch_size, max_batch_delay_ms=self.max_batch_delay_ms,
                             workers=self.workers, model_version=self.version)


@dataclass(frozen=True)
class Observed:
    """What TorchServe serves: the default version's name and every registered version."""

    default: str | None
    versions: tuple[Registered, ...] = ()

    def get(self, version: str | None) -> Registered | None:
        return next((r for r in self.versions if r.version == version), None)

    @property
    def serving(self) -> Registered | None:
        """The default version (the one requests without a version go to)."""
        return self.get(self.default)

    def names(self) -> list[str]:
        return [r.version for r in self.versions]

    def pids(self) -> Iterator[int]:
        for r in self.versions:
            yield from r.pids


async def observe(ts: TorchServeClient) -> Observed:
    """Every registered version and the default one (two reads of the management API).

    Raises:
        UpstreamUnavailable: TorchServe did not answer.
    """
    versions = tuple(Registered.from_description(d) for d in await ts.describe_all())
    if not versions:
        return Observed(default=None)
    try:
        default: str | None = str((await ts.describe())["modelVersion"])
    except NotRegistered:  # unregistered between the two reads
        default = None
    return Observed(default=default, versions=versions)


def _positive(value: Any) -> bool:
    try:
        return int(value) > 0
    except (TypeError, ValueError):
        return False
