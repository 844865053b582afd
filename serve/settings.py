"""Every environment variable the project reads, defined once: name, default, help, where.

A module that reads (or sets) one of these imports its :class:`EnvVar` from here and
never spells the name itself (``tests/test_settings.py`` scans for ``"DLRM_..."`` and
``"TS_..."`` literals anywhere else). ``docs/configuration.md`` is generated from this
registry and the config dataclasses' field metadata (``python -m serve.ops.configdoc``).

Nothing here reads the environment at import time: a reader takes the mapping to read
(``environ``, default ``os.environ``) when it is called::

    from serve import settings

    port = settings.TS_INFERENCE_PORT.get_port()
    log_dir = settings.DLRM_PREDICTION_LOG_DIR.get(environ)   # None: unset or blank

``default`` is the text a reader falls back on when the variable is unset or blank.
None means the default lives elsewhere: for a variable that sets a sidecar flag, it is
the config dataclass field's default (``serve.sidecar.config``: "the flag's default");
for the others, the reader's caller (``get_int(default=...)``) or "unset".

About ``TS_*`` names: TorchServe itself reads ``TS_<PROPERTY>`` variables as
config.properties overrides only with ``enable_envvars_config=true``, which
``config.properties`` leaves off; so ``TS_MODEL_STORE`` and the ``TS_*_URL``/``TS_*_PORT``
variables below are this project's own settings. TorchServe's frontend does set
``TS_DECODE_INPUT_REQUEST`` for every Python worker it starts (from ``decode_input_request``);
the handler overrides it inside the worker.

Light on purpose (the pod, the handler and every tool import it): stdlib and
``serve.errors`` only.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from serve.constants import (
    DEFAULT_GRPC_INFERENCE_PORT,
    DEFAULT_GRPC_MANAGEMENT_PORT,
    DEFAULT_INFERENCE_PORT,
    DEFAULT_MANAGEMENT_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_SIDECAR_OIP_PORT,
    DEFAULT_SIDECAR_PORT,
    DEFAULT_SIDECAR_WRITE_PORT,
)
from serve.errors import ConfigError

__all__ = [
    "BENCH",
    "DLRM_ARCHIVE_VERIFY_KEY",
    "DLRM_AUTOTUNE",
    "DLRM_CACHE_ON_CPU",
    "DLRM_DEBUG_CANDIDATE_SLOWDOWN",
    "DLRM_DELTA_DIR",
    "DLRM_DELTA_POLL_MS",
    "DLRM_DELTA_VERIFY_KEY",
    "DLRM_DRAIN_FILE",
    "DLRM_FEEDBACK_INDEX_ENTRIES",
    "DLRM_FEEDBACK_MAX_BODY_BYTES",
    "DLRM_FEEDBACK_WINDOW_S",
    "DLRM_FLEET",
    "DLRM_HOST_CACHE_BYTES",
    "DLRM_HOST_CACHE_FRACTION",
    "DLRM_LOG_LEVEL",
    "DLRM_MAX_DELTA_BYTES",
    "DLRM_MAX_DELTA_STORE_BYTES",
    "DLRM_MEMORY_LIMIT_BYTES",
    "DLRM_MODEL_NAME",
    "DLRM_P99_GOAL_MS",
    "DLRM_PREDICTION_LOG_DIR",
    "DLRM_PREDICTION_LOG_FILE_BYTES",
    "DLRM_PREDICTION_LOG_MAX_BYTES",
    "DLRM_PREDICTION_LOG_SAMPLE",
    "DLRM_REPOSITORY",
    "DLRM_REQUEST_LOG",
    "DLRM_REUSE_SAMPLE",
    "DLRM_ROUTE_KEY_SALT",
    "DLRM_ROUTE_KEY_SALT_FILE",
    "DLRM_SHARED_TABLES",
    "DLRM_SIDECAR_DELTA_TOKEN_FILE",
    "DLRM_SIDECAR_FEEDBACK_TOKEN_FILE",
    # the variables, in REGISTRY order
    "DLRM_SIDECAR_HOST",
    "DLRM_SIDECAR_OIP_PORT",
    "DLRM_SIDECAR_PORT",
    "DLRM_SIDECAR_TOKEN",
    "DLRM_SIDECAR_TOKEN_FILE",
    "DLRM_SIDECAR_URL",
    "DLRM_SIDECAR_WRITE_PORT",
    "DLRM_STATE_FILE",
    "DLRM_TUNE_MIN_DWELL_S",
    "DLRM_TUNE_MIN_SWITCH_INTERVAL_S",
    "DLRM_TUNE_SETTLE_S",
    "DLRM_TUNE_WINDOW_S",
    "GRPC_INFERENCE_PORT",
    "GRPC_MANAGEMENT_PORT",
    "LAUNCHER",
    "LOADTEST_HOST",
    "LOADTEST_SIDECAR",
    "LOAD_DURATION",
    "LOAD_SHAPE",
    "LOAD_TEST",
    "OMP_NUM_THREADS",
    "POD_NAME",
    "PROFILE",
    "PROMETHEUS_MULTIPROC_DIR",
    "REGISTRY",
    "SIDECAR",
    "SIDECAR_OIP_PORT",
    "SIDECAR_PORT",
    "SIDECAR_WRITE_PORT",
    "TOOLS",
    "TORCHSERVE",
    "TS_DECODE_INPUT_REQUEST",
    "TS_INFERENCE_PORT",
    "TS_INFERENCE_URL",
    "TS_MANAGEMENT_PORT",
    "TS_MANAGEMENT_URL",
    "TS_METRICS_PORT",
    "TS_METRICS_URL",
    "TS_MODEL_STORE",
    "WHERE",
    "WORKER",
    "EnvVar",
    "by_name",
]

# Where a variable applies: who reads it.
SIDECAR = "sidecar"
WORKER = "worker"  # TorchServe's Python workers (the handler); set on TorchServe's process
TORCHSERVE = "TorchServe"  # TorchServe's Java frontend
LAUNCHER = "launcher"  # python -m serve.ops.launcher (make run / make up)
TOOLS = "tools"  # serve.ops tools: drain (the preStop hook), capacity, state client
LOAD_TEST = "load test"  # python -m loadtest.run (make loadtest)
BENCH = "bench"  # bench/*.py
WHERE: tuple[str, ...] = (SIDECAR, WORKER, TORCHSERVE, LAUNCHER, TOOLS, LOAD_TEST, BENCH)

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, where it applies, its default and what it does.

    Attributes:
        name: the variable (``DLRM_DELTA_DIR``).
        help: what it does, one or two sentences (the docs' text).
        where: who reads it (:data:`WHERE`).
        default: the text used when it is unset or blank; None: see the module docstring.
    """

    name: str
    help: str
    where: tuple[str, ...]
    default: str | None = None

    def __post_init__(self) -> None:
        if not self.where or any(w not in WHERE for w in self.where):
            raise ValueError(f"{self.name}: where={self.where!r} must name some of {WHERE}")

    def __str__(self) -> str:
        return self.name

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value, stripped; None when unset or blank (no default applied)."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value is None or not value.strip():
            return None
        return value.strip()

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value (stripped), else :attr:`default` (None when that is None too)."""
        value = self.raw(environ)
        return self.default if value is None else value

    def get_int(self, environ: Mapping[str, str] | None = None,
                default: int | None = None) -> int | None:
        """The value as an integer; ``default`` when unset. ConfigError when not one."""
        text = self.get(environ)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{self.name}={text!r} is not an integer; set a whole number "
                              "or unset it") from None

    def get_float(self, environ: Mapping[str, str] | None = None,
                  default: float | None = None) -> float | None:
        """The value as a number; ``default`` when unset. ConfigError when not one."""
        text = self.get(environ)
        if text is None:
            return default
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{self.name}={text!r} is not a number; set one (e.g. 2.5) "
                              "or unset it") from None

    def get_bool(self, environ: Mapping[str, str] | None = None,
                 default: bool | None = None) -> bool | None:
        """``1/true/on/yes`` or ``0/false/off/no`` (any case); ``default`` when unset."""
        text = self.get(environ)
        if text is None:
            return default
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{self.name}={text!r} must be one of {'/'.join(_TRUE)} (on) or "
                          f"{'/'.join(_FALSE)} (off)")

    def get_port(self, environ: Mapping[str, str] | None = None,
                 default: int | None = None) -> int | None:
        """A TCP port (1..65535); ``default`` when unset. ConfigError otherwise."""
        text = self.get(environ)
        if text is None:
            return default
        if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
            raise ConfigError(f"{self.name}={text!r} must be a port number (1..65535)")
        return int(text)

    def get_list(self, environ: Mapping[str, str] | None = None,
                 sep: str = ":") -> tuple[str, ...]:
        """The ``sep``-separated items, empty ones dropped; () when unset."""
        text = self.get(environ)
        return tuple(p for p in (text or "").split(sep) if p.strip())


def _var(name: str, help: str, *where: str, default: str | None = None) -> EnvVar:
    return EnvVar(name, help, tuple(where), default)


# --------------------------------------------------------------------------- sidecar
# Each sets the default of one flag of python -m serve.sidecar (named in the flag's field
# metadata: serve.sidecar.config and the configs it holds); the default and the full help
# are the flag's.
DLRM_SIDECAR_HOST = _var("DLRM_SIDECAR_HOST", "The bind address.", SIDECAR)
DLRM_SIDECAR_PORT = _var("DLRM_SIDECAR_PORT", "The sidecar's port.", SIDECAR)
TS_INFERENCE_URL = _var("TS_INFERENCE_URL", "TorchServe's inference API.", SIDECAR)
TS_MANAGEMENT_URL = _var("TS_MANAGEMENT_URL", "TorchServe's management API.",
                         SIDECAR)
TS_METRICS_URL = _var("TS_METRICS_URL", "TorchServe's metrics API.", SIDECAR)
DLRM_MODEL_NAME = _var("DLRM_MODEL_NAME", "The TorchServe model to manage.",
                       SIDECAR)
DLRM_SIDECAR_TOKEN = _var(
    "DLRM_SIDECAR_TOKEN",
    "The sidecar's write token: the bearer token every write (PUT /state, PUT /batching, "
    "PUT /tuner, POST /feedback, POST /embeddings/deltas, POST /drain) needs. Wins over "
    "the sidecar's --token-file; the tools (drain, capacity, the state client) send it "
    "too. In Kubernetes it comes from the Secret dlrm-sidecar-token.", SIDECAR, TOOLS)
DLRM_SIDECAR_TOKEN_FILE = _var("DLRM_SIDECAR_TOKEN_FILE",
                               "The file holding the write token.", SIDECAR)
# The edge: the write port and the scoped tokens (serve.sidecar.http.edge).
DLRM_SIDECAR_WRITE_PORT = _var(
    "DLRM_SIDECAR_WRITE_PORT", "The sidecar's write port (every write; reads too).", SIDECAR)
DLRM_SIDECAR_OIP_PORT = _var(
    "DLRM_SIDECAR_OIP_PORT",
    "The sidecar's Open Inference Protocol (KServe v2) port; 0: not served.", SIDECAR)
DLRM_SIDECAR_DELTA_TOKEN_FILE = _var(
    "DLRM_SIDECAR_DELTA_TOKEN_FILE",
    "The file holding the delta publisher's token (POST /embeddings/deltas only).", SIDECAR)
DLRM_SIDECAR_FEEDBACK_TOKEN_FILE = _var(
    "DLRM_SIDECAR_FEEDBACK_TOKEN_FILE",
    "The file holding the feedback producer's token (POST /feedback only).", SIDECAR)
PROMETHEUS_MULTIPROC_DIR = _var(
    "PROMETHEUS_MULTIPROC_DIR",
    "prometheus_client's multiprocess folder: the workers write their metrics there (the "
    "launcher sets it on TorchServe and empties it at start; a starting worker removes "
    "the files of dead ones). It also sets the default of the sidecar's --multiproc-dir, "
    "which reads them; the launcher keeps it out of the sidecar's own environment.",
    WORKER, SIDECAR, LAUNCHER)
TS_MODEL_STORE = _var(
    "TS_MODEL_STORE",
    "TorchServe's model store, where the sidecar writes the archives it registers "
    "(TorchServe itself does not read it: enable_envvars_config is off).", SIDECAR)
DLRM_STATE_FILE = _var("DLRM_STATE_FILE",
                       "The desired-state file; unset: no reconciler.", SIDECAR)
DLRM_REPOSITORY = _var(
    "DLRM_REPOSITORY",
    "Model repository folders, ':'-separated: the sidecar's versions, and where the "
    "workers find each version's tables folder (<model>-<version>.tables, beside its "
    "archive: the archive carries only a reference, the rows are mapped in place). The "
    "launcher sets it on TorchServe.", SIDECAR, WORKER, LAUNCHER)
DLRM_MEMORY_LIMIT_BYTES = _var(
    "DLRM_MEMORY_LIMIT_BYTES",
    "TorchServe's memory limit in bytes when it runs in another container than "
    "the sidecar (Downward API resourceFieldRef limits.memory).", SIDECAR)
DLRM_PREDICTION_LOG_DIR = _var(
    "DLRM_PREDICTION_LOG_DIR",
    "The prediction log folder: the workers append what they answered there (unset: no "
    "log). It also sets the default of the sidecar's --prediction-log-dir, which joins "
    "POST /feedback labels with it. The launcher sets it on TorchServe.",
    WORKER, SIDECAR, LAUNCHER)
DLRM_FEEDBACK_WINDOW_S = _var("DLRM_FEEDBACK_WINDOW_S",
                              "Seconds a labelled prediction counts online.", SIDECAR)
DLRM_FEEDBACK_INDEX_ENTRIES = _var("DLRM_FEEDBACK_INDEX_ENTRIES",
                                   "Logged request ids the feedback join remembers.",
                                   SIDECAR)
DLRM_FEEDBACK_MAX_BODY_BYTES = _var(
    "DLRM_FEEDBACK_MAX_BODY_BYTES",
    "Bytes one POST /feedback body may have (413 past it; never buffered beyond it).",
    SIDECAR)
DLRM_DELTA_DIR = _var(
    "DLRM_DELTA_DIR",
    "The pod's embedding-delta folder, shared by the workers (they follow "
    "<dir>/<version>/; unset: no deltas) and the sidecar (it sets the default of "
    "--delta-dir; POST /embeddings/deltas stores deltas there). The launcher sets it on "
    "TorchServe.", WORKER, SIDECAR, LAUNCHER)
# Embedding deltas within the sidecar's memory, drains that survive a restart (one block).
DLRM_MAX_DELTA_BYTES = _var(
    "DLRM_MAX_DELTA_BYTES",
    "The largest embedding delta the sidecar accepts, bytes (POST /embeddings/deltas: 413 "
    "above it; a larger file on the model volume is skipped, never read). It sets the "
    "default of --max-delta-bytes.", SIDECAR)
DLRM_MAX_DELTA_STORE_BYTES = _var(
    "DLRM_MAX_DELTA_STORE_BYTES",
    "The most bytes of embedding deltas the sidecar's delta store may hold, all versions "
    "together (POST /embeddings/deltas: 507 past it). It sets the default of "
    "--max-delta-store-bytes.", SIDECAR)
DLRM_ARCHIVE_VERIFY_KEY = _var(
    "DLRM_ARCHIVE_VERIFY_KEY",
    "The ed25519 public key file (PEM) the sidecar verifies archive digests with "
    "(<model>-<version>.mar.sha256.sig): a version whose digest is unsigned or wrongly "
    "signed is not registered. Unset: digests are checked, not their signatures. It sets "
    "the default of --archive-verify-key.", SIDECAR)
DLRM_DELTA_VERIFY_KEY = _var(
    "DLRM_DELTA_VERIFY_KEY",
    "The ed25519 public key file (PEM) the sidecar verifies embedding deltas with: "
    "unsigned or wrongly signed deltas are refused (POST: 400) or skipped (volume). Unset: "
    "signatures are not verified. It sets the default of --delta-verify-key.", SIDECAR)
DLRM_DRAIN_FILE = _var(
    "DLRM_DRAIN_FILE",
    "Where the sidecar records that the pod was drained (POST /drain), so a restarted "
    "sidecar stays drained: a pod-local file (an emptyDir), never one shared by pods. "
    "It sets the default of --drain-file (unset: <delta dir>/.drained.json).", SIDECAR)
DLRM_AUTOTUNE = _var("DLRM_AUTOTUNE",
                     "The batching tuner: 1/true/on/yes on, 0/false/off/no off.",
                     SIDECAR)
DLRM_P99_GOAL_MS = _var("DLRM_P99_GOAL_MS", "The tuner's p99 latency goal, ms.",
                        SIDECAR)
DLRM_TUNE_WINDOW_S = _var("DLRM_TUNE_WINDOW_S",
                          "The tuner's measurement window, s.", SIDECAR)
DLRM_TUNE_SETTLE_S = _var("DLRM_TUNE_SETTLE_S",
                          "Seconds the tuner skips after a switch.", SIDECAR)
DLRM_TUNE_MIN_DWELL_S = _var("DLRM_TUNE_MIN_DWELL_S",
                             "Seconds a chosen setting is kept at least.", SIDECAR)
DLRM_TUNE_MIN_SWITCH_INTERVAL_S = _var(
    "DLRM_TUNE_MIN_SWITCH_INTERVAL_S", "Seconds between two switches, at least.",
    SIDECAR)
DLRM_LOG_LEVEL = _var("DLRM_LOG_LEVEL", "The sidecar's log level.", SIDECAR)
DLRM_FLEET = _var(
    "DLRM_FLEET",
    "How the pods agree on one rollout decision: none (this pod alone), file (a local "
    "fleet, make fleet: lease and decisions in files next to the state file) or "
    "kubernetes (a Lease and a ConfigMap through the API server). It sets the default of "
    "--fleet.", SIDECAR)
POD_NAME = _var(
    "POD_NAME",
    "This pod's name in the fleet (the Downward API's metadata.name in Kubernetes): the "
    "lease holder and a decision's decided_by. It sets the default of --fleet-identity "
    "(unset: the host name).", SIDECAR)

# --------------------------------------------------------------------------- workers
# Read where a worker starts (serve.worker.Worker.load), from TorchServe's environment,
# which every worker inherits: set them on TorchServe's process (its container).
DLRM_CACHE_ON_CPU = _var(
    "DLRM_CACHE_ON_CPU",
    "1 runs the embedding cache on CPU too (on CPU it only costs time, so it is off by "
    "default); 0 serves CPU models without a cache.", WORKER, default="0")
DLRM_HOST_CACHE_BYTES = _var(
    "DLRM_HOST_CACHE_BYTES",
    "The host tier's budget in bytes per worker for versions whose tables are on disk "
    "(overrides the archive's handler.host_cache_bytes; 0 = every lookup reads the table "
    "files): size it from the pod's memory limit, so a pod smaller than its tables "
    "serves. Unset: the archive's setting (default: no bound, the mapped files). Set it "
    "on the sidecar too: its memory check for a switch counts the budget.", WORKER,
    SIDECAR)
DLRM_HOST_CACHE_FRACTION = _var(
    "DLRM_HOST_CACHE_FRACTION",
    "The same budget as a fraction (0..1) of the version's table bytes, per worker "
    "(overrides handler.host_cache_fraction); at most one of the two.", WORKER, SIDECAR)
DLRM_DEBUG_CANDIDATE_SLOWDOWN = _var(
    "DLRM_DEBUG_CANDIDATE_SLOWDOWN",
    "FOR TESTS AND BENCHMARKS ONLY: a rollout candidate's forwards take this many times "
    "their time (>= 1; the worker busy-waits the rest), so a rollout run can prove the latency "
    "guard rolls a slower model back. Overrides handler.debug_candidate_slowdown; never "
    "set it where real traffic is served.", WORKER, default="1")
DLRM_SHARED_TABLES = _var(
    "DLRM_SHARED_TABLES",
    "With DLRM_DELTA_DIR set, on CPU without a cache: 1 makes the workers share one copy "
    "of the tables (<dir>/<version>/tables.bin); 0 gives each a private copy (what "
    "bench/bench_memory.py compares with).", WORKER, BENCH, default="1")
DLRM_DELTA_POLL_MS = _var(
    "DLRM_DELTA_POLL_MS",
    "How often a worker looks for new embedding deltas, ms (10..60000).", WORKER,
    default="100")
DLRM_ROUTE_KEY_SALT = _var(
    "DLRM_ROUTE_KEY_SALT",
    "The fleet's secret that keys the X-DLRM-Route-Key hash (serve.store.routing), so a "
    "client cannot compute which rollout arm its key lands in. Wins over "
    "DLRM_ROUTE_KEY_SALT_FILE. Every worker of every pod must have the same one (a key "
    "keeps its arm across the fleet); unset in both: the hash is unkeyed (logged).", WORKER)
DLRM_ROUTE_KEY_SALT_FILE = _var(
    "DLRM_ROUTE_KEY_SALT_FILE",
    "The file holding the route-key secret (in Kubernetes: a key of a Secret mounted "
    "read-only, like the sidecar's tokens).", WORKER)
DLRM_PREDICTION_LOG_SAMPLE = _var(
    "DLRM_PREDICTION_LOG_SAMPLE",
    "Share of requests the prediction log keeps, in [0, 1], chosen by a hash of the "
    "request id, so every worker and the sidecar agree.", WORKER)
DLRM_PREDICTION_LOG_FILE_BYTES = _var(
    "DLRM_PREDICTION_LOG_FILE_BYTES",
    "A worker starts a new prediction log file past this many bytes (>= 4096).", WORKER)
DLRM_PREDICTION_LOG_MAX_BYTES = _var(
    "DLRM_PREDICTION_LOG_MAX_BYTES",
    "The prediction log folder's bound in bytes, at least twice the file size; whenever a "
    "worker starts a file, the oldest files go until the folder fits.", WORKER)
DLRM_REUSE_SAMPLE = _var(
    "DLRM_REUSE_SAMPLE",
    "Share R of table rows (0..1) whose accesses each worker samples for the capacity "
    "advisor's reuse distances (dlrm_reuse_distance_rows, make cache-advice), chosen by a "
    "hash of (table, id); a worker tracks at most 16384 rows and lowers R past that. 0 "
    "turns the sampler off. Measured ~0.1 ms per batch of 512 x 26 ids at 0.001.",
    WORKER, default="0.001")
OMP_NUM_THREADS = _var(
    "OMP_NUM_THREADS",
    "torch intra-op threads per worker when the archive's handler.num_threads is not set "
    "(a comma list: its first entry); unset: the CPU quota split over the workers "
    "(serve.common.cpu.choose_threads).", WORKER)
TS_DECODE_INPUT_REQUEST = _var(
    "TS_DECODE_INPUT_REQUEST",
    "Set by TorchServe's frontend for every Python worker it starts (from "
    "config.properties' decode_input_request, default true) and read by TorchServe's "
    "worker code; the handler sets it to false inside its worker, so request bodies reach "
    "it as raw bytes (parsed with orjson).", WORKER, default="true")
DLRM_REQUEST_LOG = _var(
    "DLRM_REQUEST_LOG",
    "The level of TorchServe's per-request log lines (access log, batch aggregator, "
    "worker threads), read by log4j2.xml when TorchServe starts: info brings them back.",
    TORCHSERVE, default="warn")

# --------------------------------------------------------------------------- launcher
TS_INFERENCE_PORT = _var(
    "TS_INFERENCE_PORT",
    "TorchServe's inference port when the launcher's --inference-port is not given (make "
    "up TS_INFERENCE_PORT=8180); the load test and bench/bench_e2e.py aim at it too.",
    LAUNCHER, LOAD_TEST, BENCH, default=str(DEFAULT_INFERENCE_PORT))
TS_MANAGEMENT_PORT = _var(
    "TS_MANAGEMENT_PORT", "TorchServe's management port when --management-port is not given.",
    LAUNCHER, default=str(DEFAULT_MANAGEMENT_PORT))
TS_METRICS_PORT = _var(
    "TS_METRICS_PORT", "TorchServe's metrics port when --metrics-port is not given.",
    LAUNCHER, default=str(DEFAULT_METRICS_PORT))
SIDECAR_PORT = _var(
    "SIDECAR_PORT",
    "The sidecar's port when the launcher's --sidecar-port is not given (the launcher "
    "passes it to the sidecar as --port).", LAUNCHER, default=str(DEFAULT_SIDECAR_PORT))
SIDECAR_WRITE_PORT = _var(
    "SIDECAR_WRITE_PORT",
    "The sidecar's write port when the launcher's --sidecar-write-port is not given (the "
    "launcher passes it to the sidecar as --write-port).", LAUNCHER,
    default=str(DEFAULT_SIDECAR_WRITE_PORT))
SIDECAR_OIP_PORT = _var(
    "SIDECAR_OIP_PORT",
    "The sidecar's Open Inference Protocol (KServe v2) port when the launcher's "
    "--sidecar-oip-port is not given (the launcher passes it to the sidecar as --oip-port).",
    LAUNCHER, default=str(DEFAULT_SIDECAR_OIP_PORT))
GRPC_INFERENCE_PORT = _var(
    "GRPC_INFERENCE_PORT", "TorchServe's gRPC inference port (always started, unused).",
    LAUNCHER, default=str(DEFAULT_GRPC_INFERENCE_PORT))
GRPC_MANAGEMENT_PORT = _var(
    "GRPC_MANAGEMENT_PORT", "TorchServe's gRPC management port (always started, unused).",
    LAUNCHER, default=str(DEFAULT_GRPC_MANAGEMENT_PORT))

# --------------------------------------------------------------------------- tools
DLRM_SIDECAR_URL = _var(
    "DLRM_SIDECAR_URL",
    "The sidecar's write API (its write port) that python -m serve.ops.drain (the preStop "
    "hook) asks to drain.", TOOLS,
    default=f"http://127.0.0.1:{DEFAULT_SIDECAR_WRITE_PORT}")

# --------------------------------------------------------------------------- load test
LOADTEST_HOST = _var(
    "LOADTEST_HOST",
    "The service root the load test aims at when -H/--host is not given; unset: "
    "TorchServe on loopback at TS_INFERENCE_PORT.", LOAD_TEST)
LOADTEST_SIDECAR = _var(
    "LOADTEST_SIDECAR",
    "The sidecar (read port) the load test asks for the served state (version, batching, "
    "workers, tuner) before and after a run, to record it beside the figures; unset: the "
    "sidecar on the target's loopback host at DEFAULT_SIDECAR_PORT, none for a remote "
    "target.", LOAD_TEST)
LOAD_SHAPE = _var("LOAD_SHAPE", "The load test's --shape default (steady, step, spike, soak).",
                  LOAD_TEST, default="step")
LOAD_DURATION = _var("LOAD_DURATION", "The load test's --duration default (40s, 5m, 1h).",
                     LOAD_TEST, default="60s")
PROFILE = _var(
    "PROFILE",
    "The load test's --profile default: the served model's profile (table sizes of the "
    "id draws), as make model's PROFILE=.", LOAD_TEST, default="small")

#: Every variable, in the order defined above (the order the docs list them).
REGISTRY: tuple[EnvVar, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, EnvVar))


def by_name(name: str) -> EnvVar:
    """The registry's entry for ``name`` (KeyError naming the known ones)."""
    for var in REGISTRY:
        if var.name == name:
            return var
    raise KeyError(f"{name} is not in serve.settings.REGISTRY "
                   f"({', '.join(v.name for v in REGISTRY)})")
