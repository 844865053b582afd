"""The declared serving state: which model version to serve, and how (batching, workers).

One YAML file holds it (``.run/state.yaml`` locally; a ConfigMap mounted into every pod
in Kubernetes). The sidecar's reconciler reads it and moves TorchServe toward it; the
sidecar's ``GET /state`` shows it beside what really serves (``observed``).

The file::

    model:
      version: small-s0-1a2b3c4d      # a version in the model repository (model_store/)
      # schema_change: true           # only to switch to another request schema on purpose
    batching:
      batch_size: 2                   # requests TorchServe merges into one handler call
      max_batch_delay_ms: 0           # longest wait for a batch to fill, ms (0: only what is queued)
    workers: 2                        # worker processes
    rollout: null                     # or a canary / shadow rollout of a candidate:
    # rollout:
    #   candidate: small-int8-s7        # the version being tried
    #   mode: canary                    # canary: it answers its share; shadow: it only scores
    #   weight: 0.1                     # share of requests (by X-DLRM-Route-Key hash, else random)
    #   steps: [0.5, 1.0]               # optional: later weights, one bake period each
    #   bake_s: 60                      # seconds each weight must survive the guards
    #   attempt: 1                      # bump to try the candidate again after a decision
    #   guards: {max_error_ratio: 0.01, max_latency_ratio: 1.3, max_score_psi: 0.5,
    #            min_requests: 100, min_instances: 500, min_forwards: 30, interval_s: 5,
    #            failure_limit: 3}

Unknown keys, wrong types (``"8"``, ``8.0``, ``true`` for an integer) and out-of-range
values are refused with a message that names the field, the rule and the value.

TorchServe registers one *serving version* per (model version, batching, workers): the
batching lives in the archive's ``model-config.yaml``, so a batching change is a new
registration. :func:`serving_version` names it ``<version>_b<batch>d<delay>w<workers>``,
plus ``_c<candidate>`` when the registration also holds a rollout's candidate;
:func:`parse_serving_version` and :func:`serving_candidate` read it back, so the
observed state comes from TorchServe's own description, not from memory the sidecar
could lose.
"""
from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from serve.common.durable import write_durably
from serve.constants import (
    GUARD_FAILURE_LIMIT,
    GUARD_INTERVAL_S,
    GUARD_MAX_ERROR_RATIO,
    GUARD_MAX_LATENCY_RATIO,
    GUARD_MAX_SCORE_PSI,
    GUARD_MIN_FORWARDS,
    GUARD_MIN_INSTANCES,
    GUARD_MIN_REQUESTS,
    QUALITY_MAX_CALIBRATION_GAP,
    QUALITY_MAX_NE_INCREASE,
    QUALITY_MIN_LABELS,
)
from serve.errors import ConfigError, describe_field_errors, shown

__all__ = [
    "ALLOWED_FIELDS",
    "BATCH_SIZE_MAX",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_BATCH_DELAY_MS",
    "DEFAULT_STATE_FILE",
    "DEFAULT_WORKERS",
    "LOCAL_STATE_FILE",
    "MAX_BATCH_DELAY_MS_MAX",
    "ROLLOUT_MODES",
    "STATE_MAX_BYTES",
    "VERSION_RE",
    "WORKERS_MAX",
    "Batching",
    "DesiredState",
    "Guards",
    "ModelRef",
    "Rollout",
    "RolloutMode",
    "describe_validation_error",
    "dump_state",
    "load_state",
    "parse_serving_version",
    "parse_state",
    "read_state_yaml",
    "serving_candidate",
    "serving_version",
    "write_state",
]

# Where the pod reads the state: the ConfigMap ``dlrm-serving-state`` mounted as a folder
# (not subPath: kubelet updates a folder mount by swapping a symlink, never a subPath).
DEFAULT_STATE_FILE = "/etc/dlrm/state/state.yaml"
# Where `make up` / `make run` keep it locally (created with defaults on first start).
LOCAL_STATE_FILE = ".run/state.yaml"
BATCH_SIZE_MAX = 4096
MAX_BATCH_DELAY_MS_MAX = 10_000
WORKERS_MAX = 64
# The shipped batching and workers: what a new state declares, what a build writes into
# its archive, what `make up` falls back to. Two requests per handler call suits ranking
# requests of 100-700 instances (more starves the other worker); delay 0 merges a second
# request only when one is already queued (TorchServe's pollBatch polls the queue with no
# wait), so a light load never waits for a batch to fill, and a busy pod still merges.
# Measured A/B on 2 cores: docs/tuner.md#the-shipped-default.
DEFAULT_BATCH_SIZE = 2
DEFAULT_MAX_BATCH_DELAY_MS = 0
DEFAULT_WORKERS = 2
# Letters, digits, '.' and '-': safe in URLs, file names and TorchServe's version paths.
# No '_': it separates the model version from the batching suffix of a serving version.
VERSION_RE = r"^[A-Za-z0-9][A-Za-z0-9.\-]{0,63}$"
_SERVING_RE = re.compile(r"^(?P<v>[A-Za-z0-9][A-Za-z0-9.\-]{0,63})_b(?P<b>\d+)d(?P<d>\d+)w(?P<w>\d+)"
                         r"(?:_c(?P<c>[A-Za-z0-9][A-Za-z0-9.\-]{0,63}))?$")


class RolloutMode(StrEnum):
    """How a rollout's candidate serves: ``canary``, it answers its share of requests;
    ``shadow``, the stable version answers all and the candidate scores its share unseen."""

    CANARY = "canary"
    SHADOW = "shadow"


ROLLOUT_MODES = tuple(m.value for m in RolloutMode)
ALLOWED_FIELDS = ("model.version, model.schema_change, batching.batch_size, batching.max_batch_delay_ms, workers, "
                  "rollout.candidate, rollout.mode, rollout.weight, rollout.steps, "
                  "rollout.bake_s, rollout.guards.{max_error_ratio, max_latency_ratio, "
                  "max_score_psi, min_requests, min_instances, min_forwards, interval_s, "
                  "failure_limit}")
BAKE_S_MAX = 7 * 24 * 3600


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRef(_Strict):
    version: str = Field(pattern=VERSION_RE, description="A version in the model repository.")
    schema_change: bool = Field(
        default=False, description="True: this declaration switches model.version to a version that "
                           "takes other requests (another request schema) on purpose. Without "
                           "it, PUT /state refuses such a switch with 409 naming the "
                           "difference: every client of the old schema would get 400s.",
        # written (file, GET /state) only when set: every other declaration stays
        # model: {version: V}
        exclude_if=lambda v: not v)


class Batching(_Strict):
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, le=BATCH_SIZE_MAX,
                            description="Most requests TorchServe merges into one handler call.")
    max_batch_delay_ms: int = Field(DEFAULT_MAX_BATCH_DELAY_MS, ge=0, le=MAX_BATCH_DELAY_MS_MAX,
                                    description="Longest wait (ms) for a batch to fill.")


class Guards(_Strict):
    """When a rollout's candidate is rolled back (a limit exceeded, strictly, on
    ``failure_limit`` evaluations in a row), and how much traffic it needs before each
    guard judges. See ``serve.sidecar.control.guards``; the defaults are
    ``serve.constants.GUARD_*`` (why each: there). ``max_p99_ratio`` (a point estimate
    of request p99s) is gone: it is refused with a message naming its successor."""

    # The one declaration of every limit's field, bounds and default: the controllers
    # judge with subclasses that add only their statistical settings
    # (serve.sidecar.control.guards.GuardLimits, quality_gates.QualityLimits).

    max_error_ratio: float = Field(default=GUARD_MAX_ERROR_RATIO, ge=0, le=1,
                                   description="Candidate errors / candidate requests "
                                               "(its 99% Wilson lower bound is judged).")
    max_latency_ratio: float = Field(
        default=GUARD_MAX_LATENCY_RATIO, gt=0, le=1000,
        description="Candidate / stable forward seconds per instance (the 99% lower "
                    "confidence bound of the ratio is judged).")
    max_score_psi: float = Field(default=GUARD_MAX_SCORE_PSI, ge=0, le=100,
                                 description="Population stability index of the candidate's "
                                             "predicted scores against the stable's.")
    min_requests: int = Field(default=GUARD_MIN_REQUESTS, ge=1, le=10_000_000,
                              description="Candidate requests before the error guard "
                                          "judges.")
    min_instances: int = Field(default=GUARD_MIN_INSTANCES, ge=1, le=1_000_000_000,
                               description="Scored instances per arm before the PSI judges.")
    min_forwards: int = Field(default=GUARD_MIN_FORWARDS, ge=1, le=10_000_000,
                              description="Timed forwards per arm before the latency guard "
                                          "judges.")
    interval_s: float = Field(default=GUARD_INTERVAL_S, gt=0, le=3600,
                              description="Seconds between evaluations.")
    # The click-quality gates (serve.sidecar.control.quality_gates), judged on labels
    # posted to /feedback since the rollout began; defaults: serve.constants.QUALITY_*.
    min_labels: int = Field(default=QUALITY_MIN_LABELS, ge=0, le=1_000_000_000,
                            description="Labels per arm before the quality gates judge; "
                                        "> 0: no promotion before they judge ok; 0: they "
                                        "judge from 1000 labels but never hold a promotion.")
    max_ne_increase: float = Field(default=QUALITY_MAX_NE_INCREASE, ge=0, le=100,
                                   description="Candidate NE - stable NE (lower 99% bound).")
    max_calibration_gap: float = Field(default=QUALITY_MAX_CALIBRATION_GAP, ge=0, le=100,
                                       description="|ln calibration ratio| of the candidate "
                                                   "- the stable's (lower 99% bound).")
    failure_limit: int = Field(default=GUARD_FAILURE_LIMIT, ge=1, le=1000,
                               description="Consecutive breached evaluations of one guard "
                                           "before a rollback (error_ratio: at once).")

    @model_validator(mode="before")
    @classmethod
    def _p99_ratio_is_gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_p99_ratio" in data:
            raise ValueError(
                f"max_p99_ratio={shown(data['max_p99_ratio'])} is no longer a guard: "
                "latency is judged by max_latency_ratio (candidate / stable forward "
                f"seconds per instance, its lower confidence bound; default "
                f"{GUARD_MAX_LATENCY_RATIO}); rename the key and size the limit for it")
        return data


class Rollout(_Strict):
    """A candidate version tried beside the stable one (``model.version``).

    The weights walked are ``[weight, *steps]``, each held ``bake_s`` seconds with every
    guard evaluated every ``guards.interval_s``; a breach rolls back (weight 0, candidate
    unloaded); surviving the last weight promotes the candidate to stable.
    """

    candidate: str = Field(pattern=VERSION_RE, description="The version tried.")
    mode: Literal["canary", "shadow"] = Field(
        "canary", description="canary: the candidate answers its share; shadow: the stable "
                              "answers all and the candidate scores its share unseen.")
    weight: float = Field(ge=0, le=1, description="Share of requests for the candidate.")
    steps: list[float] = Field(default_factory=list, max_length=20,
                               description="Later weights, increasing, each > weight.")
    bake_s: float = Field(60.0, gt=0, le=BAKE_S_MAX,
                          description="Seconds each weight must survive the guards.")
    guards: Guards = Field(default_factory=lambda: Guards())
    attempt: int = Field(1, ge=1, le=1_000_000,
                         description="Bump to try a candidate again after its rollout was "
                                     "decided: a decided rollout (the same stable version and "
                                     "spec) is never baked again, not even by a restarted pod.")

    @field_validator("steps")
    @classmethod
    def _steps_increase(cls, steps: list[float], info: ValidationInfo) -> list[float]:
        walk = [info.data.get("weight", 0.0), *steps]
        for i, w in enumerate(steps):
            if not 0 < w <= 1:
                raise ValueError(f"steps[{i}]={w} must be in (0, 1]")
            if w <= walk[i]:
                raise ValueError(f"each step must be above the one before it and the first "
                                 f"above weight; steps[{i}]={w} is not above {walk[i]}")
        return steps

    def weights(self) -> list[float]:
        """The weights walked, in order: ``[weight, *steps]``."""
        return [self.weight, *self.steps]


class DesiredState(_Strict):
    """What every pod should serve; ``rollout`` optionally tries a candidate beside it."""

    model: ModelRef
    batching: Batching = Field(default_factory=lambda: Batching(
        batch_size=DEFAULT_BATCH_SIZE, max_batch_delay_ms=DEFAULT_MAX_BATCH_DELAY_MS))
    workers: int = Field(DEFAULT_WORKERS, ge=1, le=WORKERS_MAX, description="Worker processes.")
    rollout: Rollout | None = None

    @field_validator("rollout")
    @classmethod
    def _candidate_differs(cls, rollout: Rollout | None, info: ValidationInfo) -> Rollout | None:
        model = info.data.get("model")
        if rollout is not None and model is not None and rollout.candidate == model.version:
            raise ValueError(f"candidate {rollout.candidate!r} is model.version itself; name "
                             "another version to try, or set rollout to null")
        return rollout

    def serving_version(self) -> str:
        """The TorchServe version that serves exactly this state (with the rollout's
        candidate loaded beside the stable version when there is one)."""
        return serving_version(self.model.version, self.batching.batch_size,
                               self.batching.max_batch_delay_ms, self.workers,
                               self.rollout.candidate if self.rollout else None)


def serving_version(version: str, batch_size: int, max_batch_delay_ms: int, workers: int,
                    candidate: str | None = None) -> str:
    """``small-s0`` + (2, 2, 2) -> ``small-s0_b2d2w2``; with candidate ``small-s7``:
    ``small-s0_b2d2w2_csmall-s7``."""
    for v in (version, candidate):
        if v is not None and not re.fullmatch(VERSION_RE, v):
            raise ConfigError(f"model version {v!r} must match {VERSION_RE}")
    name = f"{version}_b{batch_size}d{max_batch_delay_ms}w{workers}"
    return name if candidate is None else f"{name}_c{candidate}"


def parse_serving_version(name: str) -> tuple[str, int, int, int] | None:
    """(version, batch_size, max_batch_delay_ms, workers), or None for a foreign name
    (the stable version for a registration that also holds a candidate)."""
    m = _SERVING_RE.fullmatch(name)
    if m is None:
        return None
    return m["v"], int(m["b"]), int(m["d"]), int(m["w"])


def serving_candidate(name: str) -> str | None:
    """The rollout candidate a serving version holds (``..._c<candidate>``), else None."""
    m = _SERVING_RE.fullmatch(name)
    return m["c"] if m is not None else None


def describe_validation_error(err: ValidationError, where: str = "") -> str:
    """One line per bad field: ``batching.batch_size: Input should be <= 4096 (got 0)``."""
    return "; ".join(describe_field_errors(
        err.errors(), prefix=where,
        unknown_field=f"unknown field; remove it (allowed: {ALLOWED_FIELDS})"))


def parse_state(data: Any, source: str = "desired state") -> DesiredState:
    """Validate a parsed mapping; ``ConfigError`` names every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping with model, batching, workers, rollout; "
                          f"got {type(data).__name__}")
    try:
        return DesiredState.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e)}") from None


#: The largest desired-state file or body read (bytes). The largest legitimate one, a
#: rollout of 20 steps with every guard set, is under 1 KiB; the rest is room for long
#: version names and comments, and a bound on what a ConfigMap or a client makes us parse.
STATE_MAX_BYTES = 64 * 1024


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors' aliases: a desired state needs none, and nested aliases
    ("billion laughs") expand exponentially wherever the value is walked or echoed."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"uses a YAML alias (*{str(event.anchor)[:40]}) at line "
                f"{event.start_mark.line + 1}; write the values out: a desired state "
                f"needs no anchors or aliases")
        return super().compose_node(parent, index)


def read_state_yaml(data: str | bytes, source: str = "desired state") -> Any:
    """Parse a desired state's YAML (``data``, at most :data:`STATE_MAX_BYTES`), without
    aliases; ``ConfigError`` naming ``source`` for a file too large, with an alias, or not
    valid YAML."""
    size = len(data.encode() if isinstance(data, str) else data)
    if size > STATE_MAX_BYTES:
        raise ConfigError(f"{source}: is {size} bytes; a desired state is at most "
                          f"{STATE_MAX_BYTES} bytes (model, batching, workers, rollout); "
                          f"remove what is not part of it")
    try:
        return yaml.load(data, Loader=_NoAliasLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e.message}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {e}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{source}: is nested too deeply to parse; a desired state is "
                          "at most 4 levels deep (model, batching, workers, rollout)") from None


def load_state(path: str | os.PathLike[str]) -> DesiredState:
    """Read and validate the desired-state YAML file."""
    p = Path(path)
    try:
        with open(p, "rb") as f:  # one byte past the limit tells it is over
            text = f.read(STATE_MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"desired-state file {p} does not exist; create it with `make up` "
                          "or write one (see README, 'Serving state')") from None
    return parse_state(read_state_yaml(text, f"desired-state file {p}"), source=str(p))


def dump_state(state: DesiredState) -> str:
    """The YAML text of a state (keys in schema order)."""
    text: str = yaml.safe_dump(state.model_dump(mode="json"), sort_keys=False)
    return text


def write_state(path: str | os.PathLike[str], state: DesiredState) -> None:
    """Write atomically and durably (:func:`serve.common.durable.write_durably`): a watcher
    never reads half a file, and a crash leaves the old or the new one."""
    write_durably(path, dump_state(state).encode())
