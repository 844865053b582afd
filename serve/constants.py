"""Names and numbers shared across layers, defined once: the runtime, the handler, the HTTP
contract, the metrics, the tools and the load test all import them from here.

- ``STAGES``: the stages of one predict, timed per batch and exported as the ``stage``
  label of ``dlrm_stage_duration_seconds`` (decode = body parse in the handler,
  embedding = row lookup + pooling, dense = MLPs + interaction).
- ``CACHE_POLICIES``: eviction policies of the embedding cache (``lru``, ``lfu``).
- ``DENSE_PRECISIONS``: arithmetic of the built-in DLRM's dense part (``fp32`` exact, the
  lossy ``bf16`` and ``int8`` levers), and ``DENSE_MAX_AUC_DROP``, the build's gate on them
  (``DENSE_MAX_PROB_DIFF``: an import's, which has no labels).
- ``P99_SLO_MS``: the service's p99 latency goal (the tuner, ``make capacity``, the load
  test and the alerts all judge against it).
- ``GUARD_*``: the rollout guards' default limits (``serve.state.Guards``, the declared
  state's schema, and ``serve.sidecar.control.guards.GuardLimits``, what judges).
- ``DEFAULT_*_PORT``: where TorchServe and the sidecar listen unless told otherwise.
- ``SIDECAR_TOKEN_*``: what the sidecar refuses as a token at start.
"""
from __future__ import annotations

__all__ = [
    "ARTIFACT_NAME",
    "CACHE_POLICIES",
    "CANDIDATE_ARTIFACT",
    "DEFAULT_GRPC_INFERENCE_PORT",
    "DEFAULT_GRPC_MANAGEMENT_PORT",
    "DEFAULT_INFERENCE_PORT",
    "DEFAULT_MANAGEMENT_PORT",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_SIDECAR_OIP_PORT",
    "DEFAULT_SIDECAR_PORT",
    "DEFAULT_SIDECAR_WRITE_PORT",
    "DENSE_MAX_AUC_DROP",
    "DENSE_MAX_PROB_DIFF",
    "DENSE_PRECISIONS",
    "GUARD_CONFIDENCE",
    "GUARD_FAILURE_LIMIT",
    "GUARD_INTERVAL_S",
    "GUARD_MAX_ERROR_RATIO",
    "GUARD_MAX_LATENCY_RATIO",
    "GUARD_MAX_SCORE_PSI",
    "GUARD_MIN_FORWARDS",
    "GUARD_MIN_INSTANCES",
    "GUARD_MIN_REQUESTS",
    "P99_SLO_MS",
    "QUALITY_MAX_CALIBRATION_GAP",
    "QUALITY_MAX_NE_INCREASE",
    "QUALITY_MIN_LABELS",
    "QUALITY_MIN_LABELS_TO_JUDGE",
    "QUALITY_Z",
    "SIDECAR_TOKEN_MIN_BYTES",
    "SIDECAR_TOKEN_PLACEHOLDER",
    "STAGES",
]

STAGES: tuple[str, ...] = ("decode", "embedding", "dense")
CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu")
#: The dense part's arithmetic (``handler.dense_precision``, ``--dense-precision``): "fp32"
#: is exact against TorchRec (the default); "bf16" (AMX / AVX-512 BF16 on CPU, tensor
#: cores on GPU) and "int8" (dynamic quantization, CPU) are lossy levers a build turns on
#: only through the AUC gate below.
DENSE_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8")
#: A lossy dense precision must keep the held-out AUC within this of the same artifact's
#: fp32 dense AUC (the int8 tables' bar, MLPerf's 99.9%, on the same rows).
DENSE_MAX_AUC_DROP = 0.001
#: An import has no held-out labels, so its bf16 gate bounds the probabilities instead:
#: the largest |p_bf16 - p_fp32| over the import's check batch (DLRM-v2 example: 0.0015).
DENSE_MAX_PROB_DIFF = 0.01

#: The artifact's file name inside a model archive (.mar) and the folder TorchServe
#: unpacks it into; a rollout's candidate artifact sits beside it.
ARTIFACT_NAME = "artifact.pt"
CANDIDATE_ARTIFACT = "candidate/artifact.pt"

#: The p99 latency goal of one request, in milliseconds: MLPerf DLRM-v2's server bound.
#: The batching tuner's default goal, ``make capacity``'s and the load test's default
#: ``--p99-goal-ms``, and the p99 alert's threshold (``serve.ops.monitoring``).
P99_SLO_MS = 60.0

# The rollout guards' default limits: a candidate is rolled back when a limit is exceeded
# (strictly), judged only once the window holds enough traffic.
#: Candidate errors / candidate requests, judged by its Wilson lower bound.
GUARD_MAX_ERROR_RATIO = 0.01
#: Candidate / stable forward seconds per instance, judged by the lower confidence bound
#: of the ratio (serve.sidecar.control.guards). Two loads of one model read ~1.0; the
#: slack covers the canary's smaller merged forwards (a per-forward fixed cost spread over
#: fewer instances) and CPU noise, and still catches a model 1.5x slower.
GUARD_MAX_LATENCY_RATIO = 1.3
#: One-sided confidence of the error and latency guards' lower bounds: the bound is above
#: the truth 1 time in 100, so a breach is evidence, not one noisy window.
GUARD_CONFIDENCE = 0.99
#: Consecutive evaluations a guard must breach before the rollout rolls back (Argo
#: Rollouts' failureLimit, Flagger's threshold). 3 at the default 5 s interval: a breach
#: must hold ~15 s, through the evaluations after a transient (a GC pause, a neighbour's
#: burst, a cold cache) but not through a real regression; error_ratio rolls back at once
#: (its errors reach users, and its Wilson bound is evidence already).
GUARD_FAILURE_LIMIT = 3
#: Timed forwards per arm before the latency guard judges: fewer make a rank interval
#: too wide to say anything, and the normal approximation of U needs a few dozen.
GUARD_MIN_FORWARDS = 30
#: Population stability index of the candidate's scores against the stable's: a guard
#: against a broken model, not a judge of a retrain (the click-quality gates are). Set
#: from ``make psi-calibration`` (small profile, stable s0, 30 windows per size): same-data
#: retrains (seeds 1, 2, 3, 7) read at most 0.161 in any window of >= 500 candidate
#: instances (0.0014-0.0103 over 60,000) on loadtest and on example traffic, the
#: shuffled-label model at least 7.8. 0.5 sits 3x above the worst retrain window and 15x
#: below the broken model; the textbook 0.25 ("major shift") kept half that margin.
GUARD_MAX_SCORE_PSI = 0.5
#: Candidate requests before the error guard judges: one error in 20 requests reads as a
#: 5% ratio, and a bound over a handful of requests is too wide to judge.
GUARD_MIN_REQUESTS = 100
#: Scored instances per arm before the PSI guard judges.
GUARD_MIN_INSTANCES = 500
#: Seconds between two evaluations of the guards.
GUARD_INTERVAL_S = 5.0

# Where the servers listen by default (loopback; the launcher, the sidecar's URLs, the
# load test and the benchmarks all start from these).
DEFAULT_INFERENCE_PORT = 8080
DEFAULT_MANAGEMENT_PORT = 8081
DEFAULT_METRICS_PORT = 8082
DEFAULT_SIDECAR_PORT = 8090
#: The sidecar's write API (every PUT/POST, and every read too): its own port, so that the
#: public port (metrics, probes, reads; what Prometheus and the Service reach) takes no
#: write at all, and a NetworkPolicy can open the write port to the operators only.
DEFAULT_SIDECAR_WRITE_PORT = 8091
#: The Open Inference Protocol (KServe v2) port `make up` gives the sidecar (serve.api.oip).
DEFAULT_SIDECAR_OIP_PORT = 8092
#: TorchServe 0.12 always starts its gRPC APIs (unused here); they must not collide.
DEFAULT_GRPC_INFERENCE_PORT = 7070
DEFAULT_GRPC_MANAGEMENT_PORT = 7071

#: Where ``make up`` / ``make run`` write the sidecar's write token (relative to the repo),
#: and where the sidecar and every tool read it by default.
DEFAULT_TOKEN_FILE = ".run/sidecar-token"

#: The shortest token the sidecar accepts, in bytes (UTF-8): 32 random bytes is what
#: ``openssl rand -hex 32`` (64 characters) and the development token (43) both exceed;
#: a shorter one is a password someone typed.
SIDECAR_TOKEN_MIN_BYTES = 32
#: The token of the Secret template (k8s/templates/sidecar-token-secret.yaml), refused at
#: start: applying the template unedited must not leave a token everybody knows.
SIDECAR_TOKEN_PLACEHOLDER = "REPLACE-ME-with-openssl-rand-hex-32"

# The click-quality gates of a rollout (serve.sidecar.control.quality_gates): judged on
# click labels joined by POST /feedback, each breached only when the lower end of its
# one-sided 99% confidence interval is above the limit. The limits come from
# bench/quality_calibration.py (results in bench/results/quality_calibration.json).
#: One-sided 99% normal quantile: a candidate as good as the stable breaches a gate with
#: probability <= 1% per evaluation even at a limit of 0.
QUALITY_Z = 2.326
#: Candidate NE - stable NE (both over H of the pooled CTR), dimensionless. Measured on
#: the small models' 100,000 held-out rows, 500 random splits per point: the stable
#: against itself and the seed-7 retrain breach it in <= 0.2% of splits from 1,000 labels
#: per arm (0.6% at 500; up to 2% at a limit of 0: the log loss has heavy tails), the
#: shuffled-label small-int8-s8-shuffled (NE 1.001, AUC 0.497, against NE 0.637) and a
#: base-rate model in 100% from 500.
QUALITY_MAX_NE_INCREASE = 0.02
#: |ln(candidate calibration ratio)| - |ln(stable calibration ratio)|, in log-ratio units
#: (0.05: about 5% further from calibrated than the stable). Measured as above: never
#: breached by the stable or the retrain; scores x 1.25 (ratio 1.17 against 0.98) breach
#: it in 60% of splits at 5,000 labels per arm, 99% at 10,000.
QUALITY_MAX_CALIBRATION_GAP = 0.05
#: Labels per arm a rollout waits for before it may promote (0: the gates do not block).
QUALITY_MIN_LABELS = 0
#: Labels per arm before the gates judge when they do not block (min_labels = 0).
QUALITY_MIN_LABELS_TO_JUDGE = 1000
#: How a ranking request is sent: ``context`` (the user's features and the dense vector
#: once, the items' per candidate: :mod:`serve.api.context_body`) or ``instances`` (every
#: candidate repeats everything). The load generator, locust, bench-slo, bench-work and
#: make capacity take these as ``--form``; the first is their default.
REQUEST_FORMS = ("context", "instances")
