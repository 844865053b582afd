"""A real Prometheus on loopback, scraping the sidecar: for checks and tests, not for pods.

In a cluster, the cluster's Prometheus scrapes every pod (``k8s/monitoring/
servicemonitor.yaml``) and evaluates ``k8s/monitoring/*.rules.yaml``. Here the same rule
files run in a Prometheus 2.42 (Debian's ``prometheus`` package; ``scripts/
ensure_prometheus.sh`` installs it) started on 127.0.0.1, with a 1 s scrape of one
sidecar. The scrape adds the ``namespace`` and ``pod`` labels that the ServiceMonitor adds
in Kubernetes, so the recording rules (and the HPA's adapter query) see the same series.

Example::

    cfg = PrometheusConfig(port=9091, targets=["127.0.0.1:8090"], data_dir=tmp)
    with PrometheusServer(cfg) as prom:
        prom.wait_for("up == 1")
        prom.query("dlrm:requests_per_second:rate1m")
"""
from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import yaml

from serve.errors import ConfigError, UpstreamUnavailable
from serve.ops import monitoring

__all__ = ["PrometheusConfig", "PrometheusServer", "Sample", "prometheus_binary"]

REPO = Path(__file__).resolve().parents[2]
MONITORING_DIR = REPO / monitoring.MONITORING_DIR
#: The rule files a cluster's Prometheus loads (recording before alerts: alerts use records).
RULE_FILES: tuple[str, ...] = ("recording.rules.yaml", "alerts.rules.yaml")


def prometheus_binary() -> str:
    """Path of the ``prometheus`` executable.

    Raises:
        ConfigError: not installed (names the script that installs it).
    """
    path = shutil.which("prometheus")
    if path is None:
        raise ConfigError("prometheus is not on PATH: run scripts/ensure_prometheus.sh "
                          "(Debian's prometheus 2.42 package; `make test` runs it)")
    return path


@dataclass(frozen=True)
class PrometheusConfig:
    """One loopback Prometheus.

    Attributes:
        port: its HTTP port on 127.0.0.1.
        targets: ``host:port`` of each sidecar to scrape (path /metrics).
        data_dir: TSDB folder (a temporary one; deleted by nobody here).
        scrape_interval_s / evaluation_interval_s: 1 s, so a minute of load gives 60 points.
        labels: static target labels, as the ServiceMonitor's relabelling adds them.
        rule_files: rule files to load (default: the shipped recording and alert rules).
    """

    port: int
    targets: Sequence[str]
    data_dir: Path
    scrape_interval_s: float = 1.0
    evaluation_interval_s: float = 1.0
    labels: dict[str, str] = field(default_factory=lambda: {"namespace": "local",
                                                            "pod": "dlrm-serve-0"})
    rule_files: Sequence[Path] = tuple(MONITORING_DIR / f for f in RULE_FILES)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ConfigError("PrometheusConfig.targets is empty: name at least one "
                              "sidecar host:port to scrape")
        if self.scrape_interval_s <= 0 or self.evaluation_interval_s <= 0:
            raise ConfigError("scrape and evaluation intervals must be > 0 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def render(self) -> dict[str, Any]:
        """prometheus.yml as data."""
        return {
            "global": {"scrape_interval": f"{self.scrape_interval_s:g}s",
                       "scrape_timeout": f"{self.scrape_interval_s:g}s",
                       "evaluation_interval": f"{self.evaluation_interval_s:g}s"},
            "rule_files": [str(Path(p).resolve()) for p in self.rule_files],
            "scrape_configs": [{
                "job_name": "dlrm-serve",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": list(self.targets), "labels": dict(self.labels)}],
            }],
        }


@dataclass(frozen=True)
class Sample:
    """One series of an instant query: its labels and value."""

    labels: dict[str, str]
    value: float


class PrometheusServer:
    """Starts ``prometheus`` with :class:`PrometheusConfig`; queries its HTTP API."""

    def __init__(self, cfg: PrometheusConfig, log_path: Path | None = None) -> None:
        self.cfg = cfg
        self.log_path = log_path or cfg.data_dir / "prometheus.log"
        self._proc: subprocess.Popen | None = None
        self._http = httpx.Client(base_url=cfg.url, timeout=30, trust_env=False)

    def start(self, ready_timeout_s: float = 60.0) -> Self:
        binary = prometheus_binary()
        self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.cfg.data_dir / "prometheus.yml"
        conf.write_text(yaml.safe_dump(self.cfg.render(), sort_keys=False))
        cmd = [binary, f"--config.file={conf}",
               f"--storage.tsdb.path={self.cfg.data_dir / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{self.cfg.port}",
               "--storage.tsdb.retention.time=2h", "--log.level=warn"]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise UpstreamUnavailable(f"prometheus exited with {self._proc.returncode} "
                                          f"at start: see {self.log_path}")
            try:
                if self._http.get("/-/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise UpstreamUnavailable(f"prometheus not ready on {self.cfg.url} after "
                                  f"{ready_timeout_s:g} s: see {self.log_path}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._http.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _api(self, path: str, params: dict[str, Any]) -> Any:
        r = self._http.get(f"/api/v1/{path}", params=params)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise ConfigError(f"prometheus {path} {params.get('query')!r}: "
                              f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """Instant query ``expr`` (at unix time ``at``, default now): its vector (a scalar
        comes back as one sample without labels).

        Raises:
            ConfigError: the expression does not parse or evaluate (Prometheus's message).
        """
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        if data["resultType"] == "scalar":
            return [Sample({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise ConfigError(f"{expr!r} returned a {data['resultType']}, not a vector")
        return [Sample(dict(s["metric"]), float(s["value"][1])) for s in data["result"]]

    def value(self, expr: str, at: float | None = None) -> float:
        """The single value of ``expr`` (NaN when it returns nothing).

        Raises:
            ConfigError: it returns more than one series.
        """
        res = self.query(expr, at)
        if len(res) > 1:
            raise ConfigError(f"{expr!r} returned {len(res)} series; expected one: "
                              f"{[s.labels for s in res]}")
        return res[0].value if res else math.nan

    def rule_health(self) -> list[tuple[str, str, str]]:
        """(rule name, health, last error) of every loaded rule."""
        out = []
        for g in self._api("rules", {})["groups"]:
            for rule in g["rules"]:
                out.append((rule["name"], rule.get("health", ""), rule.get("lastError", "")))
        return out

    def wait_for(self, expr: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> list[Sample]:
        """Poll until ``expr`` returns at least one series; return them.

        Raises:
            UpstreamUnavailable: still empty after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.query(expr)
            if res:
                return res
            if time.monotonic() > deadline:
                raise UpstreamUnavailable(f"prometheus: {expr!r} still empty after "
                                          f"{timeout_s:g} s (scrape targets: "
                                          f"{list(self.cfg.targets)}; see {self.log_path})")
            time.sleep(poll_s)
