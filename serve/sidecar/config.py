"""The sidecar's settings: where TorchServe is, how long each call to it may take, and
where the desired serving state and the model versions are.

Loaded once, at the entry point (``serve.sidecar.http.app.main``); everything else receives a
:class:`SidecarConfig`. :class:`ServerOptions` holds what only the process needs (bind
address, log level, where the write token is).

The sidecar's lowest layer: it imports nothing from the sidecar's other layers, which
import it (the tuner reads :class:`TunerConfig`, the feedback join :class:`FeedbackConfig`).

The command line is generated from these dataclasses (and the :class:`FeedbackConfig` and
:class:`TunerConfig` they hold): a field with ``metadata=flag(...)``
(:mod:`serve.common.flags`) is a flag of ``python -m serve.sidecar``, with its help and the
environment variable (:mod:`serve.settings`) that sets its default; the field's default
is the flag's. Fields without it (``upstream_timeout_s``, ``switch_grace_s``...) are set
only in code.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from serve import settings
from serve.common.flags import Option, flag, options
from serve.common.validate import int_in_range, number_in_range, positive_int
from serve.constants import (
    DEFAULT_INFERENCE_PORT,
    DEFAULT_MANAGEMENT_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_SIDECAR_OIP_PORT,
    DEFAULT_SIDECAR_PORT,
    DEFAULT_SIDECAR_WRITE_PORT,
    DEFAULT_TOKEN_FILE,
    P99_SLO_MS,
    SIDECAR_TOKEN_MIN_BYTES,
    SIDECAR_TOKEN_PLACEHOLDER,
)
from serve.errors import ConfigError
from serve.state import (  # the limits are the desired state's: defined once there
    BATCH_SIZE_MAX,
    DEFAULT_STATE_FILE,
    MAX_BATCH_DELAY_MS_MAX,
    WORKERS_MAX,
)
from serve.store.deltas.files import MAX_DELTA_STORE_BYTES
from serve.store.deltas.format import MAX_DELTA_BYTES

__all__ = [
    "BATCH_SIZE_MAX",
    "DEFAULT_CGROUP_ROOT",
    "DEFAULT_STATE_FILE",
    "DELTAS_POST_MODES",
    "FLEET_MODES",
    "LOG_LEVELS",
    "MAX_BATCH_DELAY_MS_MAX",
    "OIP_MODES",
    "POD_SELECTOR",
    "WORKERS_MAX",
    "FeedbackConfig",
    "FleetConfig",
    "ServerOptions",
    "SidecarConfig",
    "TunerConfig",
    "check_token",
    "cli_options",
]

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
#: ``--deltas-post``: ``store`` (POST adds to this pod's delta folder) or ``refuse`` (a
#: pod of a fleet: deltas are published on the model volume, which every pod follows).
DELTAS_POST_MODES = ("store", "refuse")
LOG_LEVELS = ("debug", "info", "warning", "error")
FLEET_MODES = ("none", "file", "kubernetes")
#: The serving pods' labels (k8s/deployment.yaml): what the fleet's peer Service
#: (``FleetConfig.peer_service``) and the NetworkPolicies select. The model-upload pod
#: carries the name but another component, so it is never a peer.
POD_SELECTOR = "app.kubernetes.io/name=dlrm-serve,app.kubernetes.io/component=inference"
#: ``--oip-mode``: ``child`` (the sidecar starts the Open Inference Protocol's process
#: itself, ``make up`` and the tests) or ``external`` (it runs in a container of its own,
#: Kubernetes; the sidecar only names its port in GET /state).
OIP_MODES = ("child", "external")


@dataclass(frozen=True)
class FeedbackConfig:
    """Bounds of the click-feedback join (:mod:`serve.sidecar.services.feedback` says why).

    Attributes:
        log_dir: the prediction log folder the workers write; None: no log, every label
            is ``unknown``.
        index_entries: request ids the index remembers (the newest).
        window_s: seconds a labelled prediction stays in the window (from when its label
            arrived).
        window_pairs: labelled predictions a window keeps at most (the newest).
        max_series: (version, arm) windows kept; the least recently labelled goes first.
        max_labels: labels one POST may carry.
        max_body_bytes: bytes one POST /feedback body may have (413 past it). The body is
            read in the chunks the server delivers and never held beyond this.
    """

    log_dir: Path | None = field(default=None, metadata=flag(
        "--prediction-log-dir", env=settings.DLRM_PREDICTION_LOG_DIR,
        help="the prediction log folder TorchServe's workers write; POST /feedback joins "
             "labels with it. Unset: no join (every label counts as unknown)"))
    index_entries: int = field(default=200_000, metadata=flag(
        "--feedback-index-entries", env=settings.DLRM_FEEDBACK_INDEX_ENTRIES,
        help="logged request ids the join remembers (~160 bytes each, measured: the "
             "default 200000 is ~32 MB); a restart reads only the newest this many records"))
    window_s: float = field(default=3600.0, metadata=flag(
        "--feedback-window-s", env=settings.DLRM_FEEDBACK_WINDOW_S,
        help="seconds a labelled prediction counts in the online CTR, calibration and AUC"))
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata=flag(
        "--feedback-max-body-bytes", env=settings.DLRM_FEEDBACK_MAX_BODY_BYTES,
        help="bytes one POST /feedback body may have: a longer one is refused with 413 as "
             "soon as its Content-Length or the bytes received pass it, never buffered "
             "(100,000 labels with UUID request ids are ~7 MB)"))
    window_pairs: int = 500_000
    max_series: int = 8
    max_labels: int = 100_000

    def __post_init__(self) -> None:
        for name in ("index_entries", "window_pairs", "max_series", "max_labels",
                     "max_body_bytes"):
            positive_int(f"feedback {name}", getattr(self, name))
        if not (isinstance(self.window_s, (int, float)) and self.window_s > 0):
            raise ConfigError(f"feedback window_s={self.window_s!r} must be > 0 (seconds)")


@dataclass(frozen=True)
class TunerConfig:
    """How the tuner judges and how often it may act.

    enabled: tune at all (``--autotune off`` / ``DLRM_AUTOTUNE=0`` turn it off; then the
        declared batching serves).
    p99_goal_ms: a setting whose estimated p99 exceeds it is not chosen (MLPerf DLRM-v2
        server bound, as ``make capacity``).
    interval_s: between two observations.
    window_s: one measurement window, at most (a trial is judged on one window).
    quick_window_s, quick_requests: a window closes early once it spans ``quick_window_s``
        and holds ``quick_requests`` requests (fast traffic: a search of three trials then
        ends within the first minute instead of after ~90 s; slow traffic keeps the full
        window).
    settle_s: skipped after a switch before measuring (new workers warm up, the old
        version drains).
    min_requests: a window with fewer requests judges nothing (too little traffic).
    min_dwell_s: a chosen setting is kept at least this long.
    min_switch_interval_s: no two switches of the tuner closer than this.
    hysteresis: a search's winner displaces a setting that needs no switch (the one
        serving, else the one from before the search) only when its instances/s is
        higher by more than this fraction.
    seed_margin: a neighbour displaces the seed only when its instances/s is higher by
        more than this fraction, and the seed counts as meeting the p99 goal up to this
        fraction over it. The seed is the queueing model's answer; the neighbours check
        it, and one window is noisy here: the same setting's instances/s moved by 10-30%
        between 3-s windows (trials picked 24/5 and 22/5 over the seed and then served
        9-19% below static 32/5), and the p99 estimate was 16% over wrk's p99 for batch 1
        (60.6 vs 52 ms: the seed 1/2 was dropped for 2/2, whose real p99 was 96 ms).
    shape_change: a new search starts when instances per request or concurrency moved by
        more than this factor since the search that chose the serving setting.
    min_queue_per_worker: no search starts while fewer requests than this are in flight
        per worker on average and the serving setting meets the p99 goal. So light a load
        rarely queues two requests for one worker: every setting then serves it alike,
        and a search would rank arrival noise (under open-loop traffic a window's
        instances/s is the clients' rate, not the setting's) while each of its switches
        reloads the workers beside the traffic (measured on 2 cores, Poisson ranking
        queries at 40/s, 0.7 in flight over 2 workers: two switches in one minute and a
        p99 of 67 ms against the goal of 60).
    fill: the seed batch is ``fill x`` the requests queued per worker.
    smaller: the search's smaller neighbour is ``smaller x`` the seed batch (a batch that
        waits for the very last request in flight can stall on it).
    max_batch_instances: a batch holds at most this many instances (the forward at 512
        instances takes ~13 ms on one core; two ranking requests fill it); when at
        most two requests fit, the seed is the zero-wait merge 2 / 0 ms instead.
    small_request_instances: requests below this many instances get
        ``small_delay_ms``, others ``large_delay_ms``.
    wait_factor: p99 estimate = handler p99 + wait_factor x mean wait outside the handler.
    history: decisions kept for GET /state.
    """

    enabled: bool = field(default=True, metadata=flag(
        "--autotune", env=settings.DLRM_AUTOTUNE,
        help="the batching tuner: picks batch size and max delay from the traffic and applies "
             "them like PUT /batching (needs --state-file); off: the declared batching serves. "
             "PUT /tuner turns it on or off live"))
    p99_goal_ms: float = field(default=P99_SLO_MS, metadata=flag(
        "--p99-goal-ms", env=settings.DLRM_P99_GOAL_MS, help="the tuner's p99 latency goal in ms"))
    interval_s: float = 1.0
    window_s: float = field(default=10.0, metadata=flag(
        "--tune-window-s", env=settings.DLRM_TUNE_WINDOW_S,
        help="seconds of traffic the tuner measures a setting on, at most (a window closes "
             "after 3 s once it holds 2,000 requests)"))
    quick_window_s: float = 3.0
    quick_requests: int = 2000
    settle_s: float = field(default=4.0, metadata=flag(
        "--tune-settle-s", env=settings.DLRM_TUNE_SETTLE_S,
        help="seconds skipped after a switch before measuring"))
    min_requests: int = 200
    min_dwell_s: float = field(default=30.0, metadata=flag(
        "--tune-min-dwell-s", env=settings.DLRM_TUNE_MIN_DWELL_S,
        help="seconds a setting the tuner chose is kept at least"))
    min_switch_interval_s: float = field(default=10.0, metadata=flag(
        "--tune-min-switch-interval-s", env=settings.DLRM_TUNE_MIN_SWITCH_INTERVAL_S,
        help="seconds between two switches of the tuner, at least"))
    hysteresis: float = 0.05
    seed_margin: float = 0.15
    shape_change: float = 1.5
    min_queue_per_worker: float = 0.5
    fill: float = 1.0
    smaller: float = 0.75
    max_batch_instances: int = 512
    max_batch_size: int = 128
    small_request_instances: float = 16.0
    small_delay_ms: int = 5
    large_delay_ms: int = 2
    wait_factor: float = 2.0
    history: int = 20

    def __post_init__(self) -> None:
        for name in ("p99_goal_ms", "interval_s", "window_s", "shape_change", "fill",
                     "small_request_instances"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"tuner {name}={v!r} must be a finite number > 0")
        for name in ("settle_s", "quick_window_s", "min_dwell_s", "min_switch_interval_s",
                     "hysteresis", "seed_margin", "wait_factor", "min_queue_per_worker"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"tuner {name}={v!r} must be a finite number >= 0")
        if self.shape_change <= 1:
            raise ConfigError(f"tuner shape_change={self.shape_change} must be > 1 (a factor)")
        if self.fill > 1:
            raise ConfigError(f"tuner fill={self.fill} must be in (0, 1]")
        for name in ("min_requests", "quick_requests", "max_batch_instances", "history"):
            if getattr(self, name) < 1:
                raise ConfigError(f"tuner {name}={getattr(self, name)} must be >= 1")
        if not 1 <= self.max_batch_size <= BATCH_SIZE_MAX:
            raise ConfigError(f"tuner max_batch_size={self.max_batch_size} must be in "
                              f"1..{BATCH_SIZE_MAX}")
        for name in ("small_delay_ms", "large_delay_ms"):
            if not 0 <= getattr(self, name) <= MAX_BATCH_DELAY_MS_MAX:
                raise ConfigError(f"tuner {name}={getattr(self, name)} must be in "
                                  f"0..{MAX_BATCH_DELAY_MS_MAX}")


@dataclass(frozen=True)
class FleetConfig:
    """One rollout decision per fleet (:mod:`serve.sidecar.control.fleet`).

    Attributes:
        mode: ``none`` (this pod decides alone; its own leader), ``file`` (a local fleet:
            lease, decisions and the pod list in files) or ``kubernetes`` (a
            coordination.k8s.io Lease, the decisions in a ConfigMap, the peers listed by
            label, through the API server with the pod's service account).
        identity: this pod's name (the lease holder, ``decided_by``); None: the host name.
        lease_s: the lease expires this long after its holder's last renewal (every
            reconcile pass): how long a fleet may go without a judge after its leader died.
        run_dir: (file) where the lease (``rollout-lease.json``), the decisions
            (``rollout-decisions.json``) and the pod list (``fleet.json``) are; None: the
            state file's folder.
        lease_name: (kubernetes) the Lease's name.
        decisions_configmap: (kubernetes) the ConfigMap holding the decisions and the
            settled state: the only ConfigMap the pods write (never the operator's
            ``dlrm-serving-state``).
        peer_service: (kubernetes) the Service whose ready EndpointSlice endpoints are the
            fleet's pods (``dlrm-serve-metrics``, whose selector is :data:`POD_SELECTOR`:
            the serving pods only, never the model-upload pod).
        peer_timeout_s: a peer's GET /metrics slower than this is skipped.
    """

    mode: str = field(default="none", metadata=flag(
        "--fleet", env=settings.DLRM_FLEET, choices=FLEET_MODES,
        help="how the pods agree on one rollout decision: none (this pod alone), file (a "
             "local fleet, make fleet) or kubernetes (a Lease and a ConfigMap); without one "
             "every pod judges its own traffic and keeps its outcome in memory"))
    identity: str | None = field(default=None, metadata=flag(
        "--fleet-identity", env=settings.POD_NAME,
        help="this pod's name in the fleet (lease holder, decided_by); unset: the host name"))
    lease_s: float = field(default=15.0, metadata=flag(
        "--fleet-lease-s",
        help="seconds the rollout lease lasts without renewal: how long a fleet may go "
             "without a judge after its leader died"))
    run_dir: Path | None = field(default=None, metadata=flag(
        "--fleet-dir",
        help="(file) folder of the lease, the decisions and fleet.json; unset: the state "
             "file's folder"))
    lease_name: str = "dlrm-serve-rollout"
    decisions_configmap: str = "dlrm-serve-rollout"
    peer_service: str = "dlrm-serve-metrics"
    peer_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in FLEET_MODES:
            raise ConfigError(f"fleet mode {self.mode!r} must be one of {FLEET_MODES}")
        for name in ("lease_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fleet {name}={getattr(self, name)} must be > 0 seconds")
        if self.identity is not None and not re.fullmatch(
                r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", self.identity):
            raise ConfigError(f"fleet identity {self.identity!r} must be a pod name (letters, "
                              "digits, '.', '_', '-')")
        if self.run_dir is not None:
            object.__setattr__(self, "run_dir", Path(self.run_dir))


@dataclass(frozen=True)
class ServerOptions:
    """How ``python -m serve.sidecar`` runs: what the process needs, the app never sees.

    Attributes:
        host, port: where uvicorn listens: the public port (metrics, probes, reads; a
            write there answers 403 naming the write port).
        write_port: the write port, on the same host, in the same process: every route
            (writes and reads). Never equal to ``port``.
        oip_port: the Open Inference Protocol (KServe v2) port, same host, served by a
            process of its own (:mod:`serve.sidecar.http.oip_server`); 0: not served.
        oip_mode: :data:`OIP_MODES`: ``child`` (the sidecar starts that process, without
            its tokens, and stops it) or ``external`` (its own container starts it).
        token_file: the file holding the write token (when ``DLRM_SIDECAR_TOKEN`` is
            unset); ``create_token`` writes a random one there first if it is absent.
        delta_token_file, feedback_token_file: the files holding the scoped tokens (the
            delta publisher's, the feedback producer's); None: no such token.
        log_level: the sidecar's log level (uvicorn's too).
    """

    host: str = field(default="127.0.0.1", metadata=flag(
        "--host", env=settings.DLRM_SIDECAR_HOST,
        help="bind address; 0.0.0.0 in a pod so Prometheus can scrape it"))
    port: int = field(default=DEFAULT_SIDECAR_PORT, metadata=flag(
        "--port", env=settings.DLRM_SIDECAR_PORT,
        help="the public port: metrics, probes and reads; writes are refused there"))
    write_port: int = field(default=DEFAULT_SIDECAR_WRITE_PORT, metadata=flag(
        "--write-port", env=settings.DLRM_SIDECAR_WRITE_PORT,
        help="the write port (every write, reads too), so a NetworkPolicy can open writes "
             "to the operators alone while Prometheus and the probes use --port"))
    oip_port: int = field(default=0, metadata=flag(
        "--oip-port", env=settings.DLRM_SIDECAR_OIP_PORT,
        help="the Open Inference Protocol (KServe v2) port: /v2/health, model metadata "
             "and infer, forwarded to TorchServe's predictions API so batching, rollouts "
             "and metrics are our API's; a port of its own so a NetworkPolicy can open it "
             "to clients like the inference port; 0: not served (make up serves it on "
             f"{DEFAULT_SIDECAR_OIP_PORT})"))
    oip_mode: str = field(default="child", metadata=flag(
        "--oip-mode", choices=OIP_MODES,
        help="who runs the Open Inference Protocol's process (python -m "
             "serve.sidecar.http.oip_server, no tokens, its own memory and CPU): child = "
             "this sidecar starts it on --oip-port and stops it; external = a container of "
             "its own does (Kubernetes), the sidecar only names it in GET /state"))
    token_file: Path = field(default=Path(DEFAULT_TOKEN_FILE), metadata=flag(
        "--token-file", env=settings.DLRM_SIDECAR_TOKEN_FILE,
        help=f"file holding the write token (the bearer token of every write); env "
             f"{settings.DLRM_SIDECAR_TOKEN} (e.g. from a Kubernetes Secret) wins over it"))
    create_token: bool = field(default=False, metadata=flag(
        "--create-token", switch=True,
        help="write a random development token to --token-file if it is absent"))
    delta_token_file: Path | None = field(default=None, metadata=flag(
        "--delta-token-file", env=settings.DLRM_SIDECAR_DELTA_TOKEN_FILE,
        help="file holding the delta publisher's token: it may POST /embeddings/deltas "
             "and nothing else (the offline pipeline holds it, not the operator's)"))
    feedback_token_file: Path | None = field(default=None, metadata=flag(
        "--feedback-token-file", env=settings.DLRM_SIDECAR_FEEDBACK_TOKEN_FILE,
        help="file holding the feedback producer's token: it may POST /feedback and "
             "nothing else (the click pipeline holds it, not the operator's)"))
    log_level: str = field(default="info", metadata=flag(
        "--log-level", env=settings.DLRM_LOG_LEVEL, choices=LOG_LEVELS,
        help="the sidecar's log level"))

    def __post_init__(self) -> None:
        int_in_range("port", self.port, 1, 65535)
        int_in_range("write_port", self.write_port, 1, 65535)
        if self.write_port == self.port:
            raise ConfigError(
                f"write_port={self.write_port} is the public port too; the write API needs "
                f"a port of its own (default {DEFAULT_SIDECAR_WRITE_PORT}): pass another "
                f"--write-port or --port")
        int_in_range("oip_port", self.oip_port, 0, 65535)
        if self.oip_port in (self.port, self.write_port):
            raise ConfigError(
                f"oip_port={self.oip_port} is the public or the write port too; the Open "
                f"Inference Protocol needs a port of its own (make up uses "
                f"{DEFAULT_SIDECAR_OIP_PORT}): pass another --oip-port, or 0 for none")
        if self.oip_mode not in OIP_MODES:
            raise ConfigError(f"oip_mode={self.oip_mode!r} must be one of {OIP_MODES}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r} must be one of {LOG_LEVELS}")
        object.__setattr__(self, "token_file", Path(self.token_file))
        for name in ("delta_token_file", "feedback_token_file"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))


@dataclass(frozen=True)
class SidecarConfig:
    """Where TorchServe is and how the sidecar talks to it.

    Args:
        inference_url, management_url, metrics_url: TorchServe's APIs (loopback).
        model_name: the TorchServe model the sidecar manages.
        token: the operator's token, the bearer token of every write (PUT /state, PUT
            /batching, POST /feedback...); None disables the writes only it may do (403).
            At least :data:`~serve.constants.SIDECAR_TOKEN_MIN_BYTES` bytes, never the
            Secret template's placeholder (:func:`check_token`).
        delta_token: the delta publisher's token: POST /embeddings/deltas only; None: none.
        feedback_token: the feedback producer's token: POST /feedback only; None: none.
            The three tokens must differ (a token has one scope).
        multiproc_dir: the workers' PROMETHEUS_MULTIPROC_DIR; None: no handler metrics.
        model_store: TorchServe's ``--model-store``: new versions' ``.mar`` files go there,
            because TorchServe registers local archives only from its model store.
        upstream_timeout_s: per call to TorchServe for reads (metrics, describe, probes);
            short so that a hung TorchServe cannot hang a Prometheus scrape or a probe.
        register_timeout_s: how long a new version may take to load and get READY.
        switch_grace_s: how long an old version's queue must stay empty (on top of its
            ``max_batch_delay``) before it is unregistered. TorchServe's description does
            not show a batch a worker has already taken off the queue; unregistering
            while it runs would lose it. Keep it above the slowest batch's handler time.
        drain_timeout_s: how long the old version's queue may take to empty after the
            switch. Past it, the old version stays registered (unregistering it would
            fail the requests still queued) and the update reports no removed version.
        state_file: the desired-state YAML (:mod:`serve.state`) the reconciler moves
            TorchServe toward; None turns the reconciler off (PUT /state and PUT
            /batching then answer 409).
        repositories: model repository folders (:class:`serve.store.repository.ModelRepository`);
            empty: ``model_store`` alone.
        reconcile_interval_s: between two reconcile passes (a PUT wakes it at once). The
            file is re-read by path each pass, so a ConfigMap update (kubelet swaps a
            symlink) is seen within one interval of kubelet's own sync.
        cgroup_root: where the cgroup's memory files are (``memory.max``,
            ``memory.current``; v1: ``memory/memory.limit_in_bytes``...). Tests pass a
            folder of fake files.
        memory_limit_bytes: TorchServe's memory limit when it is not the sidecar's own
            cgroup limit (separate containers); None: read it from ``cgroup_root``.
        memory_headroom: a switch is refused when usage + the new version's estimated
            need exceeds this fraction of the limit (the rest absorbs the estimate's error
            and the page cache; an OOM kill would fail every request in flight).
        host_cache_bytes, host_cache_fraction: the workers' host tier budget
            (``DLRM_HOST_CACHE_*``, as TorchServe's): a switch to a version whose tables
            are on disk counts this, not every table byte, per worker.
        feedback: the prediction log folder the workers write and the bounds of the
            click-feedback join (:class:`FeedbackConfig`).
        delta_dir: the pod's embedding-delta store (:class:`serve.store.deltas.files.DeltaStore`), a
            folder the TorchServe workers read too; POST /embeddings/deltas adds to it.
            None turns deltas off (POST /embeddings/deltas answers 409).
        delta_sync_s: every this many seconds, take the deltas published on the model
            volume (``<repository>/deltas/<version>/``) for the served versions
            (:meth:`serve.sidecar.services.deltas.volume.VolumeSync.sync`); 0 = never.
            The same loop deletes the delta folders of versions no longer served
            (:func:`~serve.sidecar.services.deltas.cleanup.clean_versions`; every 5 s
            when ``delta_sync_s`` is 0).
        max_delta_bytes: the largest embedding delta accepted (POST and the volume);
            ``DeltaIntake.max_bytes``, also what the request guard allows that route.
        max_delta_store_bytes: the most bytes of deltas the delta folder may hold
            (``DeltaIntake.max_store_bytes``).
        delta_volume: where published deltas are read instead of the repositories'
            ``deltas/`` folders (:attr:`delta_volume_roots`); a volume with its own writer.
        delta_verify_key: the ed25519 public key file deltas must be signed with
            (:mod:`serve.store.deltas.signature`); None: signatures are not verified.
        archive_verify_key: the ed25519 public key file archive digests must be signed
            with (:meth:`serve.store.repository.ModelRepository.check_archive`); None:
            digests are checked, signatures are not.
        drain_file: where a drain is recorded so a restarted sidecar stays drained
            (:attr:`drain_marker`).
        tuner: the batching tuner (:class:`TunerConfig`; on by
            default, acting only with a desired-state file).
        deltas_post: :data:`DELTAS_POST_MODES`: ``store`` (POST /embeddings/deltas adds to
            this pod's delta folder) or ``refuse`` (a pod of a fleet: the POST answers 409
            naming the model volume, ``<repository>/deltas/<version>/``, where deltas are
            published once for every pod; :mod:`serve.sidecar.services.deltas.volume`).
        fleet: one rollout decision per fleet (:class:`FleetConfig`; off by default).
    """

    inference_url: str = field(default=f"http://127.0.0.1:{DEFAULT_INFERENCE_PORT}",
                               metadata=flag("--inference-url", env=settings.TS_INFERENCE_URL,
                                             help="TorchServe inference API"))
    management_url: str = field(
        default=f"http://127.0.0.1:{DEFAULT_MANAGEMENT_PORT}",
        metadata=flag("--management-url", env=settings.TS_MANAGEMENT_URL,
                      help="TorchServe management API, loopback only"))
    metrics_url: str = field(default=f"http://127.0.0.1:{DEFAULT_METRICS_PORT}",
                             metadata=flag("--metrics-url", env=settings.TS_METRICS_URL,
                                           help="TorchServe metrics API"))
    model_name: str = field(default="dlrm", metadata=flag(
        "--model-name", env=settings.DLRM_MODEL_NAME, help="TorchServe model to manage"))
    token: str | None = field(default=None, repr=False, metadata=flag(
        env=settings.DLRM_SIDECAR_TOKEN,
        help="the write token; wins over --token-file. Unset and no token file: writes "
             "are disabled (403)"))
    delta_token: str | None = field(default=None, repr=False)
    feedback_token: str | None = field(default=None, repr=False)
    multiproc_dir: Path | None = field(default=None, metadata=flag(
        "--multiproc-dir", env=settings.PROMETHEUS_MULTIPROC_DIR,
        cli_default=Path(".run/prometheus"),
        help="the TorchServe workers' PROMETHEUS_MULTIPROC_DIR, where their metrics are"))
    model_store: Path = field(default=Path("model_store"), metadata=flag(
        "--model-store", env=settings.TS_MODEL_STORE,
        help="TorchServe's --model-store; new versions' .mar files are written there"))
    upstream_timeout_s: float = 2.0
    register_timeout_s: float = field(default=600.0, metadata=flag(
        "--register-timeout", help="seconds a new model version may take to get READY"))
    switch_grace_s: float = 1.0
    drain_timeout_s: float = field(default=60.0, metadata=flag(
        "--drain-timeout",
        help="seconds an old version's queue may take to empty after a switch; past it "
             "the old version stays registered and the next pass retries"))
    state_file: Path | None = field(default=None, metadata=flag(
        "--state-file", env=settings.DLRM_STATE_FILE,
        help=f"the desired serving state (YAML, serve/state.py) the sidecar reconciles "
             f"TorchServe toward; in Kubernetes {DEFAULT_STATE_FILE} (a ConfigMap mounted "
             f"as a folder). Unset: no reconciler, PUT /state and PUT /batching answer 409"))
    repositories: tuple[Path, ...] = field(default=(), metadata=flag(
        "--repository", env=settings.DLRM_REPOSITORY,
        help="a model repository folder (repeat for more; earlier wins; the variable: "
             "':'-separated); unset: --model-store"))
    reconcile_interval_s: float = field(default=1.0, metadata=flag(
        "--reconcile-interval",
        help="seconds between reconcile passes (a PUT wakes it at once): how soon a "
             "ConfigMap edit or a dead worker is noticed"))
    cgroup_root: Path = field(default=DEFAULT_CGROUP_ROOT, metadata=flag(
        "--cgroup-root",
        help="cgroup filesystem with memory.max/memory.current (v1: memory/...): the "
             "memory limit a switch must fit in"))
    memory_limit_bytes: int | None = field(default=None, metadata=flag(
        "--memory-limit-bytes", env=settings.DLRM_MEMORY_LIMIT_BYTES,
        help="TorchServe's memory limit when it runs in another container than the "
             "sidecar (Downward API limits.memory of that container); unset: the "
             "sidecar's cgroup limit"))
    memory_headroom: float = 0.9
    host_cache_bytes: int | None = field(default=None, metadata=flag(
        "--host-cache-bytes", env=settings.DLRM_HOST_CACHE_BYTES,
        help="the workers' host tier budget in bytes per worker (as TorchServe's "
             "DLRM_HOST_CACHE_BYTES): a switch's memory check counts it instead of "
             "every table byte"))
    host_cache_fraction: float | None = field(default=None, metadata=flag(
        "--host-cache-fraction", env=settings.DLRM_HOST_CACHE_FRACTION,
        help="the same budget as a fraction of the table bytes (one of the two)"))
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    delta_dir: Path | None = field(default=None, metadata=flag(
        "--delta-dir", env=settings.DLRM_DELTA_DIR,
        help="the pod's embedding-delta folder, shared with the TorchServe workers (they "
             "follow <dir>/<version>/); POST /embeddings/deltas stores deltas there. "
             "Unset: deltas are off (POST answers 409)"))
    delta_sync_s: float = 5.0
    max_delta_bytes: int = field(default=MAX_DELTA_BYTES, metadata=flag(
        "--max-delta-bytes", env=settings.DLRM_MAX_DELTA_BYTES,
        help="the largest embedding delta accepted, bytes: a larger POST is refused with "
             "413 before it is read, a larger file on the model volume is skipped. The "
             "sidecar streams a delta to the delta folder (memory-backed in Kubernetes: "
             "charged to the pod), so keep it under the memory the pod can spare"))
    max_delta_store_bytes: int = field(default=MAX_DELTA_STORE_BYTES, metadata=flag(
        "--max-delta-store-bytes", env=settings.DLRM_MAX_DELTA_STORE_BYTES,
        help="the most bytes of embedding deltas the delta folder may hold, every version "
             "and the body being received together: a POST that would pass it gets 507. "
             "A version's deltas stay until it stops being served; in Kubernetes the "
             "folder is memory-backed and its deltas are charged to the sidecar's "
             "container, so size the container from this bound (README, Memory)"))
    delta_volume: Path | None = field(default=None, metadata=flag(
        "--delta-volume",
        help="the folder the published embedding deltas are read from, as "
             "<folder>/deltas/<version>/*.delta: a volume of its own with its own writer "
             "(Kubernetes: the dlrm-deltas PVC), so a delta publisher needs no write "
             "access to the model volume, whose archives are code. Never a --repository. "
             "Unset: each --repository's deltas/ folder"))
    delta_verify_key: Path | None = field(default=None, metadata=flag(
        "--delta-verify-key", env=settings.DLRM_DELTA_VERIFY_KEY,
        help="the ed25519 public key (PEM; python -m serve.ops.keys generate) embedding "
             "deltas must be signed with: an unsigned or wrongly signed delta is refused "
             "(POST: 400) or skipped (model volume), before any byte is stored. Unset: "
             "signatures are not verified (logged at start, GET /state says so), so "
             "whoever can write the model volume or POST can change the embeddings"))
    archive_verify_key: Path | None = field(default=None, metadata=flag(
        "--archive-verify-key", env=settings.DLRM_ARCHIVE_VERIFY_KEY,
        help="the ed25519 public key (PEM) model archives' digests must be signed with "
             "(python -m serve.ops.keys sign-archives): a version whose digest is unsigned "
             "or wrongly signed is not registered (PUT /state: 400). Unset: each archive's "
             "recorded sha256 is checked, its signature is not"))
    drain_file: Path | None = field(default=None, metadata=flag(
        "--drain-file", env=settings.DLRM_DRAIN_FILE,
        help="a pod-local file recording that POST /drain drained the pod, so a "
             "restarted sidecar stays drained (never a file shared by pods, and in a pod "
             "never on a volume the model container mounts: model code could forge or "
             "delete it; k8s/deployment.yaml puts it on the sidecar's own emptyDir). "
             "Unset: <delta-dir>/.drained.json, or not recorded without a delta folder"))
    tuner: TunerConfig = field(default_factory=TunerConfig)
    deltas_post: str = field(default="store", metadata=flag(
        "--deltas-post", choices=DELTAS_POST_MODES,
        help="what POST /embeddings/deltas does: store = add the delta to this pod's "
             "delta folder (one pod: make up, tests); refuse = answer 409 naming the model "
             "volume to publish on instead (a pod of a fleet, Kubernetes): a delta posted "
             "to one pod would live in that pod only, and every pod follows the volume"))
    fleet: FleetConfig = field(default_factory=FleetConfig)

    def __post_init__(self) -> None:
        if not (self.delta_sync_s >= 0 and self.delta_sync_s != float("inf")):
            raise ConfigError(f"delta_sync_s {self.delta_sync_s} must be a finite number of "
                              "seconds >= 0 (0 = do not read deltas from the model volume)")
        for name in ("inference_url", "management_url", "metrics_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.match(r"^https?://[^/]+", value):
                raise ConfigError(
                    f"{name}={value!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8081")
            object.__setattr__(self, name, value.rstrip("/"))
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$", self.model_name):
            raise ConfigError(f"model_name={self.model_name!r} must be letters, digits, _ or -")
        self._check_tokens()
        for name in ("upstream_timeout_s", "register_timeout_s", "drain_timeout_s",
                     "reconcile_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.switch_grace_s < 0:
            raise ConfigError(f"switch_grace_s={self.switch_grace_s} must be >= 0 seconds")
        if self.multiproc_dir is not None:
            object.__setattr__(self, "multiproc_dir", Path(self.multiproc_dir))
        object.__setattr__(self, "model_store", Path(self.model_store))
        if self.state_file is not None:
            object.__setattr__(self, "state_file", Path(self.state_file))
        if self.delta_dir is not None:
            if not str(self.delta_dir).strip():
                raise ConfigError("delta_dir is empty; pass a folder (shared with the "
                                  f"workers, {settings.DLRM_DELTA_DIR}) or None to turn "
                                  "deltas off")
            object.__setattr__(self, "delta_dir", Path(self.delta_dir))
        object.__setattr__(self, "repositories", tuple(Path(r) for r in self.repositories))
        object.__setattr__(self, "cgroup_root", Path(self.cgroup_root))
        if self.memory_limit_bytes is not None:
            positive_int("memory_limit_bytes", self.memory_limit_bytes,
                         then=" (bytes) or None to read the cgroup's limit")
        number_in_range("memory_headroom", self.memory_headroom, 0, 1, lo_open=True)
        if self.host_cache_bytes is not None:
            int_in_range("host_cache_bytes", self.host_cache_bytes, 0, 1 << 50,
                         then=" (host tier bytes per worker)")
        if self.host_cache_fraction is not None:
            number_in_range("host_cache_fraction", self.host_cache_fraction, 0, 1)
            if self.host_cache_bytes is not None:
                raise ConfigError("host_cache_bytes and host_cache_fraction are both set "
                                  "(DLRM_HOST_CACHE_BYTES, DLRM_HOST_CACHE_FRACTION); set "
                                  "one of the two")
        positive_int("max_delta_bytes", self.max_delta_bytes,
                     then=" (bytes): the largest embedding delta accepted")
        if self.max_delta_store_bytes < self.max_delta_bytes:
            raise ConfigError(
                f"max_delta_store_bytes={self.max_delta_store_bytes} is below "
                f"max_delta_bytes={self.max_delta_bytes}: the store could not hold one "
                f"delta of the largest size; raise --max-delta-store-bytes or lower "
                f"--max-delta-bytes")
        if self.drain_file is not None:
            object.__setattr__(self, "drain_file", Path(self.drain_file))
        if self.delta_volume is not None:
            object.__setattr__(self, "delta_volume", Path(self.delta_volume))
        for name in ("delta_verify_key", "archive_verify_key"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.deltas_post not in DELTAS_POST_MODES:
            raise ConfigError(f"deltas_post={self.deltas_post!r} must be one of "
                              f"{', '.join(DELTAS_POST_MODES)}")
        if self.deltas_post == "refuse" and self.delta_dir is not None \
                and self.delta_sync_s == 0:
            raise ConfigError("deltas_post='refuse' with delta_sync_s=0: this pod would take "
                              "embedding deltas neither by POST nor from the model volume; "
                              "set delta_sync_s > 0 or deltas_post='store'")

    @property
    def drain_marker(self) -> Path | None:
        """Where a drain is recorded: ``drain_file``, else ``<delta_dir>/.drained.json``
        (pod-local), else None (not recorded)."""
        if self.drain_file is not None:
            return self.drain_file
        return self.delta_dir / ".drained.json" if self.delta_dir is not None else None

    def _check_tokens(self) -> None:
        tokens = {name: getattr(self, name) for name in ("token", "delta_token",
                                                         "feedback_token")}
        for name, token in tokens.items():
            if token is not None:
                check_token(name, token)
        given = [name for name, token in tokens.items() if token is not None]
        for i, a in enumerate(given):
            for b in given[i + 1:]:
                if tokens[a] == tokens[b]:
                    raise ConfigError(
                        f"{a} and {b} are the same token; each token has one scope (the "
                        f"operator's, the delta publisher's, the feedback producer's): "
                        f"give each its own (openssl rand -hex 32)")

    @property
    def repository_roots(self) -> tuple[Path, ...]:
        """The model repository folders: ``repositories``, else ``model_store``."""
        return self.repositories or (self.model_store,)

    @property
    def delta_volume_roots(self) -> tuple[Path, ...]:
        """Where published deltas are read (``<root>/deltas/<version>/``): the delta
        volume alone when ``delta_volume`` is set, else the repository folders."""
        return (self.delta_volume,) if self.delta_volume is not None else self.repository_roots


def check_token(name: str, token: str) -> None:
    """ConfigError for a token the sidecar must not accept: shorter than
    :data:`~serve.constants.SIDECAR_TOKEN_MIN_BYTES` bytes, or the Secret template's
    placeholder (:data:`~serve.constants.SIDECAR_TOKEN_PLACEHOLDER`). The message never
    shows the token."""
    if not isinstance(token, str) or not token.strip():
        raise ConfigError(f"{name} is empty; pass a token of at least "
                          f"{SIDECAR_TOKEN_MIN_BYTES} bytes (openssl rand -hex 32) or None "
                          f"to disable the writes it allows")
    if token.strip() == SIDECAR_TOKEN_PLACEHOLDER:
        raise ConfigError(
            f"{name} is the placeholder of k8s/templates/sidecar-token-secret.yaml "
            f"({SIDECAR_TOKEN_PLACEHOLDER!r}), which everybody can read; create the Secret "
            f"with a random token: kubectl create secret generic dlrm-sidecar-token "
            f"--from-literal=token=\"$(openssl rand -hex 32)\"")
    size = len(token.encode())
    if size < SIDECAR_TOKEN_MIN_BYTES:
        raise ConfigError(
            f"{name} is {size} bytes long, under the {SIDECAR_TOKEN_MIN_BYTES}-byte minimum "
            f"(a short token can be guessed); use a random one: openssl rand -hex 32, or "
            f"python -m serve.sidecar --create-token for a development token")


def cli_options() -> list[Option]:
    """The flags of ``python -m serve.sidecar``, in its ``--help`` order:
    :class:`ServerOptions`, then :class:`SidecarConfig` with its feedback and tuner
    configs, each from its fields' metadata (:mod:`serve.common.flags`)."""
    return options(ServerOptions) + options(SidecarConfig)

