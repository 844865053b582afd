"""The sidecar: Prometheus metrics and a live batching-config API beside TorchServe.

It runs in the same pod as TorchServe and talks to it over loopback only:

* ``GET /metrics``: the handler metrics of every TorchServe worker (multiprocess
  directory), the sidecar's own metrics, ``dlrm_workers`` from the management API and
  TorchServe's own metrics scraped from its metrics port, re-exposed under ``ts_``.
  If TorchServe is down, the rest is still served (``dlrm_upstream_up`` says so).
* ``GET /batching``: ``{"batch_size", "max_batch_delay_ms", "workers", "model_version"}``
  of the model's default version.
* ``PUT /batching`` (bearer token): applies new settings with zero failed requests.
  TorchServe fixes ``batch_size``/``max_batch_delay`` at registration, and the
  ``model-config.yaml`` inside a ``.mar`` wins over the registration parameters, so the
  sidecar copies the default version's ``.mar`` with a new ``modelVersion`` and the new
  settings written into its manifest and model config, registers it, waits until its
  workers are READY, makes it the default and then unregisters the old version.
  Requests keep flowing to the old version until the switch. The change lives as long as
  the TorchServe process: persist it in the model's build settings.
* ``GET /healthz`` (the sidecar is alive), ``GET /readyz`` (the model has a READY
  worker), ``/docs`` (OpenAPI).

Run: ``python -m serve.sidecar --help``.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import time
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.errors import (
    ConfigError,
    Conflict,
    Forbidden,
    InvalidInput,
    ServeError,
    Unauthorized,
    UpstreamUnavailable,
)
from serve.metrics import (
    HandlerAggregateCollector,
    SidecarMetrics,
    torchserve_families,
    workers_family,
)

__all__ = [
    "BatchingState",
    "BatchingUpdate",
    "SidecarConfig",
    "create_app",
    "ensure_dev_token",
    "load_token",
    "main",
    "next_version",
    "register_exception_handlers",
    "rewrite_mar",
]

_log = logging.getLogger(__name__)

TOKEN_ENV = "DLRM_SIDECAR_TOKEN"
BATCH_SIZE_MAX = 4096
MAX_BATCH_DELAY_MS_MAX = 10_000
WORKERS_MAX = 64


@dataclass(frozen=True)
class SidecarConfig:
    """Where TorchServe is and how the sidecar talks to it.

    Args:
        inference_url, management_url, metrics_url: TorchServe's APIs (loopback).
        model_name: the TorchServe model the sidecar manages.
        token: bearer token for PUT /batching; None disables writes (403).
        multiproc_dir: the workers' PROMETHEUS_MULTIPROC_DIR; None: no handler metrics.
        model_store: TorchServe's ``--model-store``: new versions' ``.mar`` files go there,
            because TorchServe registers local archives only from its model store.
        upstream_timeout_s: per call to TorchServe for reads (metrics, describe, probes);
            short so that a hung TorchServe cannot hang a Prometheus scrape or a probe.
        register_timeout_s: how long a new version may take to load and get READY.
        switch_grace_s: pause between making the new version default and unregistering
            the old one, so that requests already queued on the old version finish.
    """

    inference_url: str = "http://127.0.0.1:8080"
    management_url: str = "http://127.0.0.1:8081"
    metrics_url: str = "http://127.0.0.1:8082"
    model_name: str = "dlrm"
    token: str | None = field(default=None, repr=False)
    multiproc_dir: Path | None = None
    model_store: Path = Path("model_store")
    upstream_timeout_s: float = 2.0
    register_timeout_s: float = 600.0
    switch_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("inference_url", "management_url", "metrics_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.match(r"^https?://[^/]+", value):
                raise ConfigError(
                    f"{name}={value!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8081")
            object.__setattr__(self, name, value.rstrip("/"))
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$", self.model_name):
            raise ConfigError(f"model_name={self.model_name!r} must be letters, digits, _ or -")
        if self.token is not None and not self.token.strip():
            raise ConfigError("token is empty; pass a non-empty token or None to disable writes")
        for name in ("upstream_timeout_s", "register_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.switch_grace_s < 0:
            raise ConfigError(f"switch_grace_s={self.switch_grace_s} must be >= 0 seconds")
        if self.multiproc_dir is not None:
            object.__setattr__(self, "multiproc_dir", Path(self.multiproc_dir))
        object.__setattr__(self, "model_store", Path(self.model_store))


class BatchingUpdate(BaseModel):
    """Body of PUT /batching; omitted fields keep their current value.

    Types are strict (``"8"``, ``8.0`` and ``true`` are refused) and unknown fields are
    refused, so that a typo cannot silently change nothing.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    batch_size: int | None = Field(
        None, ge=1, le=BATCH_SIZE_MAX,
        description="Most requests TorchServe merges into one handler call.")
    max_batch_delay_ms: int | None = Field(
        None, ge=0, le=MAX_BATCH_DELAY_MS_MAX,
        description="Longest wait (ms) for a batch to fill before it is sent as is.")
    workers: int | None = Field(
        None, ge=1, le=WORKERS_MAX, description="Worker processes of the new version.")

    @model_validator(mode="after")
    def _not_empty(self) -> BatchingUpdate:
        if self.batch_size is None and self.max_batch_delay_ms is None and self.workers is None:
            raise ValueError("give at least one of batch_size, max_batch_delay_ms, workers")
        return self


class BatchingState(BaseModel):
    """The default version's batching settings, as TorchServe reports them."""

    batch_size: int
    max_batch_delay_ms: int
    workers: int
    model_version: str


class BatchingUpdateResult(BatchingState):
    changed: bool
    previous: BatchingState
    seconds: float
    removed_version: str | None = None


# --------------------------------------------------------------------------- tokens


def ensure_dev_token(path: str | os.PathLike[str]) -> str:
    """Return the token in ``path``, first writing a random one (mode 0600) if absent.

    For local runs only; in Kubernetes mount a Secret and pass its file or env.
    """
    path = Path(path)
    if path.exists():
        return load_token(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + mode: the file is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token


def load_token(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (surrounding whitespace stripped); ConfigError if empty/absent."""
    path = Path(path)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"token file {path} does not exist; create it (python -m serve.sidecar "
            f"--create-token --token-file {path}) or set {TOKEN_ENV}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty; write a token into it")
    return token


# --------------------------------------------------------------------------- .mar


def next_version(current: str, taken: set[str] | frozenset[str]) -> str:
    """The version after ``current`` not in ``taken``: ``1.0`` -> ``1.1``; a version that
    is not ``MAJOR.MINOR`` gets ``.1``, ``.2``... appended."""
    m = re.fullmatch(r"(\d+)\.(\d+)", current)
    for i in range(1, 100_000):
        candidate = f"{m.group(1)}.{int(m.group(2)) + i}" if m else f"{current}.{i}"
        if candidate not in taken:
            return candidate
    raise ConfigError(f"no free version after {current!r}; unregister old versions")


def _rewrite_model_config(text: str, settings: dict[str, int]) -> str:
    import yaml  # TorchServe depends on pyyaml; import lazily to keep imports light

    config = yaml.safe_load(text) or {}
    if not isinstance(config, dict):
        raise ConfigError("the .mar's model config is not a YAML mapping")
    config.update(settings)
    return yaml.safe_dump(config, sort_keys=False)


def rewrite_mar(src: Path, dst: Path, *, version: str, batch_size: int,
                max_batch_delay_ms: int, workers: int) -> Path:
    """Copy the model archive ``src`` to ``dst`` with ``modelVersion = version`` in
    ``MAR-INF/MANIFEST.json`` and the batching settings in its model config (the file
    the manifest's ``configFile`` names), which TorchServe prefers over registration
    parameters. Other entries are copied unchanged; ``dst`` is written atomically."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise UpstreamUnavailable(
            f"the model archive {src} of the default version is not in the model store; "
            f"pass --model-store with TorchServe's --model-store directory")
    tmp = dst.with_name(dst.name + ".tmp")
    with zipfile.ZipFile(src) as zin:
        try:
            manifest = json.loads(zin.read("MAR-INF/MANIFEST.json"))
        except KeyError:
            raise UpstreamUnavailable(f"{src} has no MAR-INF/MANIFEST.json; not a .mar") from None
        manifest.setdefault("model", {})["modelVersion"] = version
        config_name = manifest["model"].get("configFile")
        settings = {"batchSize": batch_size, "maxBatchDelay": max_batch_delay_ms,
                    "minWorkers": workers, "maxWorkers": workers}
        with zipfile.ZipFile(tmp, "w") as zout:
            for info in zin.infolist():
                if info.filename == "MAR-INF/MANIFEST.json":
                    zout.writestr(info, json.dumps(manifest, indent=2))
                elif config_name and info.filename == config_name:
                    text = zin.read(info).decode()
                    zout.writestr(info, _rewrite_model_config(text, settings))
                else:
                    with zin.open(info) as fin, zout.open(info, "w") as fout:
                        shutil.copyfileobj(fin, fout, 1 << 20)
    os.replace(tmp, dst)
    return dst


# --------------------------------------------------------------------------- app


class _TorchServe:
    """The calls the sidecar makes to TorchServe's management and metrics APIs."""

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
            raise UpstreamUnavailable(
                f"model {m!r}" + (f" version {version}" if version else "")
                + f" is not registered in TorchServe ({url}: {_ts_message(r)})")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")
        body = r.json()
        return body[0] if isinstance(body, list) else body

    async def describe_all(self) -> list[dict[str, Any]]:
        url = f"{self.config.management_url}/models/{self.config.model_name}/all"
        r = await self._get(url, "management API")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")
        return list(r.json())

    async def ping(self) -> None:
        url = f"{self.config.inference_url}/ping"
        r = await self._get(url, "inference API")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}: {_ts_message(r)}")

    async def metrics_text(self) -> str:
        url = f"{self.config.metrics_url}/metrics"
        r = await self._get(url, "metrics API")
        if r.status_code != 200:
            raise UpstreamUnavailable(f"TorchServe {url} answered {r.status_code}")
        return r.text

    async def call(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                   timeout: float | None = None) -> httpx.Response:
        url = f"{self.config.management_url}{path}"
        try:
            r = await self.client.request(
                method, url, params=params, timeout=timeout or self.config.upstream_timeout_s)
        except httpx.HTTPError as e:
            raise UpstreamUnavailable(
                f"TorchServe {method} {url} failed ({type(e).__name__}: {e})") from None
        if r.status_code >= 300:
            raise UpstreamUnavailable(
                f"TorchServe {method} {url} answered {r.status_code}: {_ts_message(r)}")
        return r


def _ts_message(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text))[:500]
    except (ValueError, AttributeError):
        return r.text[:500]


def _state(desc: dict[str, Any]) -> BatchingState:
    return BatchingState(
        batch_size=int(desc["batchSize"]),
        max_batch_delay_ms=int(desc["maxBatchDelay"]),
        workers=len(desc.get("workers") or []),
        model_version=str(desc["modelVersion"]),
    )


def _ready_workers(desc: dict[str, Any]) -> int:
    return sum(1 for w in desc.get("workers") or [] if w.get("status") == "READY")


# auto_error=False: missing/wrong headers are answered by require_token with our JSON
# shape (401 vs 403), not by FastAPI's default. Module level, because the annotation
# is resolved from module globals (``from __future__ import annotations``).
_bearer = HTTPBearer(auto_error=False, description="PUT /batching token")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def register_exception_handlers(app: FastAPI) -> None:
    """Map every error to one JSON shape, ``{"code", "type", "message"}``, once."""

    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(exc).to_json(), status_code=InvalidInput.status)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = {"code": exc.status_code, "type": "HTTPError", "message": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(ServeError, serve_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]


_RULES = (f"batch_size: integer 1..{BATCH_SIZE_MAX}, max_batch_delay_ms: integer "
          f"0..{MAX_BATCH_DELAY_MS_MAX}, workers: integer 1..{WORKERS_MAX}")


def _validation_error(exc: RequestValidationError) -> InvalidInput:
    parts = []
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif e.get("type") == "json_invalid":
            pos = loc[0] if loc else "?"
            where = "body"
            msg = (f"the body is not valid JSON ({(e.get('ctx') or {}).get('error', 'invalid')}"
                   f" at character {pos})")
        elif e.get("type") in ("model_attributes_type", "dict_type"):
            msg = "the body must be a JSON object sent with Content-Type: application/json"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = "" if e.get("type") in ("missing", "json_invalid") else f" (got {e.get('input')!r})"
        parts.append(f"{where}: {msg}{got}")
    return InvalidInput("invalid PUT /batching body: " + "; ".join(parts)
                        + f". Allowed fields: {_RULES}")


def create_app(config: SidecarConfig, *, registry: CollectorRegistry | None = None,
               http_client: httpx.AsyncClient | None = None,
               clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The sidecar app.

    Args:
        config: see :class:`SidecarConfig`.
        registry: where the sidecar's and the workers' metrics are collected; default a
            fresh ``CollectorRegistry`` (never the global one, so apps don't collide).
        http_client: client for TorchServe; default one made and closed with the app.
        clock: monotonic seconds, for durations and deadlines.
    """
    registry = registry if registry is not None else CollectorRegistry()
    own = SidecarMetrics()
    registry.register(own)
    handler_metrics: HandlerAggregateCollector | None = None
    if config.multiproc_dir is not None:
        handler_metrics = HandlerAggregateCollector(config.multiproc_dir)
        registry.register(handler_metrics)
    update_lock = asyncio.Lock()
    running: set[asyncio.Task[BatchingUpdateResult]] = set()
    holder: dict[str, _TorchServe] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client = http_client or httpx.AsyncClient()
        holder["ts"] = _TorchServe(config, client)
        try:
            yield
        finally:
            if http_client is None:
                await client.aclose()

    app = FastAPI(
        title="DLRM serving sidecar",
        description="Prometheus metrics and live batching settings for the TorchServe "
                    "DLRM model beside it.",
        version="0.1.0", lifespan=lifespan)
    register_exception_handlers(app)

    def ts() -> _TorchServe:
        return holder["ts"]

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[..., Any]) -> Response:
        response: Response = await call_next(request)
        route = request.scope.get("route")
        own.observe_request(getattr(route, "path", "other"), request.method,
                            response.status_code)
        return response

    @app.get("/healthz", summary="The sidecar process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", summary="TorchServe's model has a READY worker and /ping answers",
             responses={503: {"description": "not ready, with the reason"}})
    async def readyz() -> JSONResponse:
        try:
            desc = await ts().describe()
        except UpstreamUnavailable as e:
            own.set_up("management", False)
            return JSONResponse(e.to_json(), status_code=503)
        own.set_up("management", True)
        ready = _ready_workers(desc)
        if ready == 0:
            statuses = sorted({str(w.get("status")) for w in desc.get("workers") or []})
            err = UpstreamUnavailable(
                f"model {config.model_name!r} version {desc.get('modelVersion')} has no READY "
                f"worker (statuses: {', '.join(statuses) or 'no workers'}); wait for it to load")
            return JSONResponse(err.to_json(), status_code=503)
        try:  # READY workers are no use if the inference API does not answer
            await ts().ping()
        except UpstreamUnavailable as e:
            return JSONResponse(e.to_json(), status_code=503)
        return JSONResponse({"status": "ready", "model": config.model_name,
                             "model_version": str(desc.get("modelVersion")),
                             "ready_workers": ready})

    @app.get("/metrics", summary="Prometheus exposition", response_class=Response)
    async def metrics() -> Response:
        text_res, all_res = await asyncio.gather(
            ts().metrics_text(), ts().describe_all(), return_exceptions=True)
        extra = CollectorRegistry()
        own.set_up("management", not isinstance(all_res, BaseException))
        if not isinstance(all_res, BaseException):
            workers = [w for d in all_res for w in d.get("workers") or []]
            if handler_metrics is not None:
                handler_metrics.reap(int(w["pid"]) for w in workers if w.get("pid"))
            extra.register(_Families([workers_family(str(w.get("status")) for w in workers)]))
        ts_ok = False
        if not isinstance(text_res, BaseException):
            try:
                extra.register(_Families(torchserve_families(text_res)))
                ts_ok = True
            except ValueError as e:
                _log.warning("TorchServe metrics are not Prometheus text: %s", e)
        own.set_up("metrics", ts_ok)
        body = await asyncio.to_thread(
            lambda: generate_latest(registry) + generate_latest(extra))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/batching", response_model=BatchingState,
             summary="Batching settings of the default model version")
    async def get_batching() -> BatchingState:
        return _state(await ts().describe())

    async def require_token(
            credentials: _Credentials) -> None:
        if config.token is None:
            raise Forbidden("this sidecar has no token configured, so PUT /batching is "
                            f"disabled; start it with --token-file or {TOKEN_ENV}")
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise Unauthorized("PUT /batching needs the header 'Authorization: Bearer <token>'"
                               f"; the token is in the sidecar's --token-file or {TOKEN_ENV}")
        if not hmac.compare_digest(credentials.credentials.encode(), config.token.encode()):
            raise Forbidden("the bearer token is wrong; use the one in the sidecar's "
                            f"--token-file or {TOKEN_ENV}")

    @app.put("/batching", response_model=BatchingUpdateResult,
             dependencies=[Depends(require_token)],
             summary="Apply new batching settings with zero failed requests",
             responses={400: {"description": "invalid body"}, 401: {}, 403: {},
                        409: {"description": "another update is in progress"},
                        503: {"description": "TorchServe could not apply it"}})
    async def put_batching(update: BatchingUpdate) -> BatchingUpdateResult:
        if update_lock.locked():
            own.observe_update("conflict")
            raise Conflict("another PUT /batching is being applied; retry when it returns")
        await update_lock.acquire()  # no await between the check and this: no race

        async def run() -> BatchingUpdateResult:
            try:
                result = await _apply(ts(), config, update, clock,
                                      handler_metrics.forget if handler_metrics else None)
            except ServeError:
                own.observe_update("failed")
                raise
            finally:
                update_lock.release()
            own.observe_update("applied" if result.changed else "unchanged", result.seconds)
            return result

        # A client that hangs up must not cancel a switch half-way (a registered but
        # unused version, a lock held by nobody): the task runs to its end regardless.
        task = asyncio.create_task(run())
        running.add(task)
        task.add_done_callback(running.discard)
        return await asyncio.shield(task)

    return app


class _Families:
    """A collector yielding fixed families (built per scrape)."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families


async def _apply(ts: _TorchServe, config: SidecarConfig, update: BatchingUpdate,
                 clock: Callable[[], float],
                 forget_workers: Callable[[list[int]], None] | None = None,
                 ) -> BatchingUpdateResult:
    """Register a new version with the settings, wait READY, switch, unregister the old.

    ``forget_workers`` gets the old version's worker pids once it is unregistered (their
    live gauges must stop counting)."""
    t0 = clock()
    m = config.model_name
    current = await ts.describe()
    before = _state(current)
    target = BatchingState(
        batch_size=update.batch_size if update.batch_size is not None else before.batch_size,
        max_batch_delay_ms=(update.max_batch_delay_ms if update.max_batch_delay_ms is not None
                            else before.max_batch_delay_ms),
        workers=update.workers if update.workers is not None else max(1, before.workers),
        model_version=before.model_version)
    if target == before:
        return BatchingUpdateResult(**before.model_dump(), changed=False, previous=before,
                                    seconds=clock() - t0)
    taken = {str(d["modelVersion"]) for d in await ts.describe_all()}
    version = next_version(before.model_version, taken)
    model_url = str(current.get("modelUrl") or "")
    src = Path(model_url) if os.path.isabs(model_url) else config.model_store / model_url
    dst = config.model_store / f"{m}-v{version}.mar"
    _log.info("batching %s -> %s: building %s", before, target, dst)
    await asyncio.to_thread(
        rewrite_mar, src, dst, version=version, batch_size=target.batch_size,
        max_batch_delay_ms=target.max_batch_delay_ms, workers=target.workers)
    registered = False
    try:
        await ts.call("POST", "/models", params={
            "url": dst.name, "model_name": m, "batch_size": target.batch_size,
            "max_batch_delay": target.max_batch_delay_ms,
            "initial_workers": target.workers, "synchronous": "true"},
            timeout=config.register_timeout_s)
        registered = True
        deadline = clock() + config.register_timeout_s
        while True:
            desc = await ts.describe(version)
            if _ready_workers(desc) >= target.workers:
                break
            if clock() > deadline:
                raise UpstreamUnavailable(
                    f"version {version} of {m!r} did not get {target.workers} READY workers "
                    f"within {config.register_timeout_s:.0f} s; the old version stays default")
            await asyncio.sleep(0.2)
        await ts.call("PUT", f"/models/{m}/{version}/set-default")
    except ServeError:
        if registered:
            try:
                await ts.call("DELETE", f"/models/{m}/{version}",
                              timeout=config.register_timeout_s)
            except ServeError as e:
                _log.error("could not unregister the failed version %s: %s", version, e)
        dst.unlink(missing_ok=True)
        raise
    _log.info("version %s is default; unregistering %s", version, before.model_version)
    # Requests routed to the old version before the switch are in its queue: let them go.
    await asyncio.sleep(config.switch_grace_s)
    removed: str | None = before.model_version
    try:
        await ts.call("DELETE", f"/models/{m}/{before.model_version}",
                      timeout=config.register_timeout_s)
        if forget_workers is not None:
            forget_workers([int(w["pid"]) for w in current.get("workers") or [] if w.get("pid")])
        old_file = src.name
        # Only archives the sidecar wrote are removed; the pipeline's own .mar stays.
        if re.fullmatch(rf"{re.escape(m)}-v.+\.mar", old_file) and src.parent == config.model_store:
            src.unlink(missing_ok=True)
    except ServeError as e:
        _log.error("new version %s is default but the old one stays registered: %s",
                   version, e)
        removed = None
    after = _state(await ts.describe())
    return BatchingUpdateResult(**after.model_dump(), changed=True, previous=before,
                                seconds=clock() - t0, removed_version=removed)


# --------------------------------------------------------------------------- CLI


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serve.sidecar",
        description="Metrics and live batching API beside TorchServe. Every flag has an "
                    "env var (shown) that sets its default.")
    p.add_argument("--host", default=_env("DLRM_SIDECAR_HOST", "127.0.0.1"),
                   help="bind address [DLRM_SIDECAR_HOST]; 0.0.0.0 in a pod so Prometheus "
                        "can scrape it")
    p.add_argument("--port", type=int, default=int(_env("DLRM_SIDECAR_PORT", "8090")),
                   help="port [DLRM_SIDECAR_PORT]")
    p.add_argument("--inference-url", default=_env("TS_INFERENCE_URL", "http://127.0.0.1:8080"),
                   help="TorchServe inference API [TS_INFERENCE_URL]")
    p.add_argument("--management-url",
                   default=_env("TS_MANAGEMENT_URL", "http://127.0.0.1:8081"),
                   help="TorchServe management API, loopback only [TS_MANAGEMENT_URL]")
    p.add_argument("--metrics-url", default=_env("TS_METRICS_URL", "http://127.0.0.1:8082"),
                   help="TorchServe metrics API [TS_METRICS_URL]")
    p.add_argument("--model-name", default=_env("DLRM_MODEL_NAME", "dlrm"),
                   help="TorchServe model to manage [DLRM_MODEL_NAME]")
    p.add_argument("--token-file", default=_env("DLRM_SIDECAR_TOKEN_FILE", ".run/sidecar-token"),
                   help=f"file holding the PUT /batching bearer token [DLRM_SIDECAR_TOKEN_FILE]; "
                        f"env {TOKEN_ENV} (e.g. from a Kubernetes Secret) wins over it")
    p.add_argument("--create-token", action="store_true",
                   help="write a random development token to --token-file if it is absent")
    p.add_argument("--multiproc-dir", default=_env("PROMETHEUS_MULTIPROC_DIR", ".run/prometheus"),
                   help="the TorchServe workers' PROMETHEUS_MULTIPROC_DIR "
                        "[PROMETHEUS_MULTIPROC_DIR]")
    p.add_argument("--model-store", default=_env("TS_MODEL_STORE", "model_store"),
                   help="TorchServe's --model-store; new versions' .mar files are written "
                        "there [TS_MODEL_STORE]")
    p.add_argument("--register-timeout", type=float, default=600.0,
                   help="seconds a new model version may take to get READY")
    p.add_argument("--log-level", default=_env("DLRM_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m serve.sidecar --help``."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per TorchServe call (every scrape) drowns the log; keep its warnings only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token is None:
        if args.create_token:
            token = ensure_dev_token(args.token_file)
            _log.info("PUT /batching token is in %s", Path(args.token_file).resolve())
        else:
            try:
                token = load_token(args.token_file)
            except ConfigError as e:
                raise SystemExit(f"serve.sidecar: {e.message}") from None
    try:
        config = SidecarConfig(
            inference_url=args.inference_url, management_url=args.management_url,
            metrics_url=args.metrics_url, model_name=args.model_name, token=token,
            multiproc_dir=Path(args.multiproc_dir), model_store=Path(args.model_store),
            register_timeout_s=args.register_timeout)
    except ConfigError as e:
        raise SystemExit(f"serve.sidecar: {e.message}") from None
    import uvicorn

    _log.info("sidecar on http://%s:%d for model %r (management %s)", args.host, args.port,
              config.model_name, config.management_url)
    uvicorn.run(create_app(config), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
