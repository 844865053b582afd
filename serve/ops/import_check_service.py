"""The real service :mod:`serve.ops.import_check` talks to: TorchServe + sidecar started
with :func:`serve.ops.launcher.start` on free 127.0.0.1 ports, one version served at a time."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from serve import settings
from serve.errors import ServeError
from serve.ops.import_check_config import Say, StepFailed

__all__ = ["Service"]

# Batching and workers every version is declared with: 1 worker with 1 torch thread, so
# the service, the reference forward and the load clients share 2 cores without
# oversubscription; batch 2 / 2 ms are the archives' own defaults.
_BATCH_SIZE, _DELAY_MS = 2, 2
_ERROR_LINE = re.compile(r"\b([A-Za-z]*Error: .+)$")

# ----------------------------------------------------------------------------- the service

class Service:
    """The real service (TorchServe + sidecar) over ``store``, on free 127.0.0.1 ports.

    :meth:`serve` makes a version the served one: the first call starts the service with
    a state file declaring it (``serve.ops.launcher.start`` waits for a real predict),
    later ones ``PUT /state``; both wait until ``converged`` with ``observed.model.version``
    the version. A version that does not get there stops the service (a switch stuck on a
    broken version would hold up the next one); the next call starts a fresh one.
    Every request sent through :meth:`post` is counted, 5xx apart.
    """

    def __init__(self, root: Path, store: Path, *, workers: int = 1,
                 converge_timeout_s: float = 240.0, say: Say = print) -> None:
        self.root, self.store = root, store
        self.workers = workers
        self.converge_timeout_s = converge_timeout_s
        self.say = say
        self.starts = 0
        self.requests = 0
        self.http_5xx = 0
        self.cfg: Any = None
        self._svc: Any = None
        self._token = ""
        self._short: Path | None = None   # run dirs when root is too deep (see _config)
        self._http = httpx.Client(timeout=120, trust_env=False)

    # -- lifecycle ---------------------------------------------------------------------
    def desired(self, version: str) -> dict[str, Any]:
        return {"model": {"version": version},
                "batching": {"batch_size": _BATCH_SIZE, "max_batch_delay_ms": _DELAY_MS},
                "workers": self.workers, "rollout": None}

    def _config(self) -> Any:
        from serve.ops.launch_config import LaunchConfig
        from serve.ops.launch_ports import free_port_settings

        run = self.root / f"service-{self.starts}"
        run_dir = run / "run"
        # TorchServe's workers listen on a unix socket in run_dir/torchserve/tmp: a path
        # over 107 bytes fails them ("AF_UNIX path too long"), so a deep root (pytest's
        # tmp_path) gets its run dir in a short temporary folder instead.
        if len(os.fsencode(run_dir / "torchserve" / "tmp" / ".ts.sock.65535")) > 100:
            if self._short is None:
                self._short = Path(tempfile.mkdtemp(prefix="ic-run-"))
            run_dir = self._short / str(self.starts)
        return LaunchConfig(
            **free_port_settings(), model_store=self.store,
            state_file=run / "state.yaml", run_dir=run_dir, log_dir=run / "logs",
            sidecar=True, ready_timeout_s=self.converge_timeout_s,
            extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            # The batching tuner would retune under the switch's load and change the
            # serving version behind the check's back.
            sidecar_env={settings.DLRM_AUTOTUNE.name: "0"})

    @property
    def running(self) -> bool:
        return self._svc is not None

    @property
    def predict_url(self) -> str:
        return f"{self.cfg.inference_url}/predictions/{self.cfg.model_name}"

    def client(self) -> Any:
        from serve.ops.state_client import StateClient

        return StateClient(self.cfg.sidecar_write_url, self._token)

    def serve(self, version: str) -> float:
        """Serve ``version``; seconds until converged on it.

        Raises:
            StepFailed: it did not serve within ``converge_timeout_s`` (the service is
                stopped; the message quotes ``GET /state`` and the workers' errors).
        """
        t0 = time.monotonic()
        try:
            if self._svc is None:
                self._start(version)
            else:
                r = self.client().put_state(self.desired(version))
                if r.status_code != 202:
                    raise StepFailed(f"PUT /state {version} answered {r.status_code}: "
                                     f"{r.text[:500]}")
            left = max(1.0, self.converge_timeout_s - (time.monotonic() - t0))
            st = self.client().wait_converged(self.desired(version), timeout_s=left)
            got = ((st.get("observed") or {}).get("model") or {}).get("version")
            if got != version:
                raise StepFailed(f"converged, but observed.model.version is {got!r}, not "
                                 f"{version!r}")
        except (ServeError, httpx.HTTPError) as e:
            why = self._diagnose(e)
            self.stop()
            raise StepFailed(f"version {version} did not serve within "
                             f"{self.converge_timeout_s:.0f} s: {why}") from None
        return time.monotonic() - t0

    def _start(self, version: str) -> None:
        from serve.ops.launcher import start
        from serve.state import Batching, DesiredState, ModelRef, write_state

        self.starts += 1
        self.cfg = self._config()
        write_state(self.cfg.path(self.cfg.state_file), DesiredState(
            model=ModelRef(version=version),
            batching=Batching(batch_size=_BATCH_SIZE, max_batch_delay_ms=_DELAY_MS),
            workers=self.workers))
        self.say(f"  starting TorchServe + sidecar (inference {self.cfg.inference_url}, "
                 f"sidecar {self.cfg.sidecar_url}, logs {self.cfg.path(self.cfg.log_dir)})")
        self._svc = start(self.cfg, say=lambda m: None)
        self._token = self.cfg.token_file.read_text().strip()

    def _diagnose(self, e: BaseException) -> str:
        """The error, ``GET /state``'s reason and last error, and the workers' first
        distinct exception lines (model_log.log)."""
        parts = [getattr(e, "message", None) or f"{type(e).__name__}: {e}"]
        if self.cfg is None:
            return parts[0]
        try:
            st = self.client().state()
            parts.append(f"state: phase {st.get('phase')!r}, reason {st.get('reason')!r}, "
                         f"last_error {st.get('last_error')!r}")
        except (httpx.HTTPError, ValueError):
            pass
        worker_errors = self.worker_errors()
        if worker_errors:
            parts.append("worker errors: " + " | ".join(worker_errors))
        return "; ".join(p[:1500] for p in parts)

    def worker_errors(self, limit: int = 2) -> list[str]:
        """The first ``limit`` distinct ``...Error: message`` lines of the workers' log."""
        if self.cfg is None:
            return []
        path = self.cfg.path(self.cfg.log_dir) / "model_log.log"
        seen: list[str] = []
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        for line in lines:
            m = _ERROR_LINE.search(line)
            if m and m.group(1)[:300] not in seen:
                seen.append(m.group(1)[:300])
                if len(seen) >= limit:
                    break
        return seen

    def stop(self) -> None:
        if self._svc is not None:
            self._svc.stop()
            self._svc = None

    def close(self) -> None:
        self.stop()
        self._http.close()
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
            self._short = None

    # -- requests ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return dict(self.client().state())

    def post(self, body: dict[str, Any]) -> httpx.Response:
        """POST a JSON body to the predict URL; counted (5xx apart)."""
        r = self._http.post(self.predict_url, content=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"})
        self.requests += 1
        if r.status_code >= 500:
            self.http_5xx += 1
        return r
