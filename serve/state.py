"""The declared serving state: which model version to serve, and how (batching, workers).

One YAML file holds it (``.run/state.yaml`` locally; a ConfigMap mounted into every pod
in Kubernetes). The sidecar's reconciler reads it and moves TorchServe toward it; the
sidecar's ``GET /state`` shows it beside what really serves (``observed``).

The file::

    model:
      version: small-s0-1a2b3c4d      # a version in the model repository (model_store/)
    batching:
      batch_size: 2                   # requests TorchServe merges into one handler call
      max_batch_delay_ms: 2           # longest wait for a batch to fill, ms
    workers: 2                        # worker processes
    rollout: null                     # reserved for canary / A-B / shadow rollouts

Unknown keys, wrong types (``"8"``, ``8.0``, ``true`` for an integer) and out-of-range
values are refused with a message that names the field, the rule and the value.

TorchServe registers one *serving version* per (model version, batching, workers): the
batching lives in the archive's ``model-config.yaml``, so a batching change is a new
registration. :func:`serving_version` names it ``<version>_b<batch>d<delay>w<workers>``;
:func:`parse_serving_version` reads it back, so the observed state comes from TorchServe's
own description, not from memory the sidecar could lose.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve.errors import ConfigError, describe_field_errors

__all__ = [
    "BATCH_SIZE_MAX",
    "DEFAULT_STATE_FILE",
    "LOCAL_STATE_FILE",
    "MAX_BATCH_DELAY_MS_MAX",
    "VERSION_RE",
    "WORKERS_MAX",
    "Batching",
    "DesiredState",
    "ModelRef",
    "describe_validation_error",
    "dump_state",
    "load_state",
    "parse_serving_version",
    "parse_state",
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
# Letters, digits, '.' and '-': safe in URLs, file names and TorchServe's version paths.
# No '_': it separates the model version from the batching suffix of a serving version.
VERSION_RE = r"^[A-Za-z0-9][A-Za-z0-9.\-]{0,63}$"
_SERVING_RE = re.compile(r"^(?P<v>[A-Za-z0-9][A-Za-z0-9.\-]{0,63})_b(?P<b>\d+)d(?P<d>\d+)w(?P<w>\d+)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelRef(_Strict):
    version: str = Field(pattern=VERSION_RE, description="A version in the model repository.")


class Batching(_Strict):
    batch_size: int = Field(2, ge=1, le=BATCH_SIZE_MAX,
                            description="Most requests TorchServe merges into one handler call.")
    max_batch_delay_ms: int = Field(2, ge=0, le=MAX_BATCH_DELAY_MS_MAX,
                                    description="Longest wait (ms) for a batch to fill.")


class DesiredState(_Strict):
    """What every pod should serve. ``rollout`` is reserved (must be null for now)."""

    model: ModelRef
    batching: Batching = Field(default_factory=lambda: Batching(batch_size=2, max_batch_delay_ms=2))
    workers: int = Field(2, ge=1, le=WORKERS_MAX, description="Worker processes.")
    rollout: None = None

    def serving_version(self) -> str:
        """The TorchServe version that serves exactly this state."""
        return serving_version(self.model.version, self.batching.batch_size,
                               self.batching.max_batch_delay_ms, self.workers)


def serving_version(version: str, batch_size: int, max_batch_delay_ms: int, workers: int) -> str:
    """``small-s0-1a2b3c4d`` + (2, 2, 2) -> ``small-s0-1a2b3c4d_b2d2w2``."""
    if not re.match(VERSION_RE, version):
        raise ConfigError(f"model version {version!r} must match {VERSION_RE}")
    return f"{version}_b{batch_size}d{max_batch_delay_ms}w{workers}"


def parse_serving_version(name: str) -> tuple[str, int, int, int] | None:
    """(version, batch_size, max_batch_delay_ms, workers), or None for a foreign name."""
    m = _SERVING_RE.match(name)
    if m is None:
        return None
    return m["v"], int(m["b"]), int(m["d"]), int(m["w"])


def describe_validation_error(err: ValidationError, where: str = "") -> str:
    """One line per bad field: ``batching.batch_size: Input should be <= 4096 (got 0)``."""
    return "; ".join(describe_field_errors(
        err.errors(), prefix=where,
        unknown_field="unknown field; remove it (allowed: model.version, batching.batch_size, "
                      "batching.max_batch_delay_ms, workers, rollout)"))


def parse_state(data: Any, source: str = "desired state") -> DesiredState:
    """Validate a parsed mapping; ``ConfigError`` names every bad field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: must be a mapping with model, batching, workers, rollout; "
                          f"got {type(data).__name__}")
    try:
        return DesiredState.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(e)}") from None


def load_state(path: str | os.PathLike[str]) -> DesiredState:
    """Read and validate the desired-state YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"desired-state file {p} does not exist; create it with `make up` "
                          "or write one (see README, 'Serving state')") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"desired-state file {p} is not valid YAML: {e}") from None
    return parse_state(data, source=str(p))


def dump_state(state: DesiredState) -> str:
    """The YAML text of a state (keys in schema order)."""
    return yaml.safe_dump(state.model_dump(mode="json"), sort_keys=False)


def write_state(path: str | os.PathLike[str], state: DesiredState) -> None:
    """Write atomically (tmp file + rename), so a watcher never reads half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(dump_state(state))
    os.replace(tmp, p)
