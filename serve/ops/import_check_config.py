"""What :mod:`serve.ops.import_check` runs: the models it knows (:data:`CASES`), one run's
options (:class:`CheckConfig`) and the error a failed step raises (:class:`StepFailed`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serve.common.validate import int_at_least
from serve.errors import ConfigError, ServeError

__all__ = [
    "BUILTIN_PROFILE",
    "CASES",
    "DEFAULT_MODELS",
    "DEFAULT_TOLERANCE",
    "REPO",
    "SWITCH_MODEL",
    "SWITCH_SEEDS",
    "CheckConfig",
    "ModelCase",
    "Say",
    "StepFailed",
]

REPO = Path(__file__).resolve().parents[2]
#: Largest |HTTP - TorchRec| probability accepted: the importer's own bar.
DEFAULT_TOLERANCE = 1e-6
#: The model fitted twice (two seeds, two versions of one schema) for the switch under load.
SWITCH_MODEL = "own_ranker"
SWITCH_SEEDS = (0, 1)
BUILTIN_PROFILE = "tiny"

Say = Callable[[str], None]


# ----------------------------------------------------------------------------- models

@dataclass(frozen=True)
class ModelCase:
    """One model the check runs.

    Attributes:
        name: the ``--examples`` name.
        stem: the version names' prefix (``<stem>-s<seed>``; versions use '-', not '_').
        factory: ``FILE.py:FUNCTION`` relative to the repository; None for ``builtin``
            (its factory module is generated, see :func:`fit_model`).
        fit_args: extra ``serve.model.fit`` flags (DLRM-v2's wide layers need a smaller
            dense learning rate).
    """

    name: str
    stem: str
    factory: str | None
    fit_args: tuple[str, ...] = ()

    def version(self, seed: int) -> str:
        return f"{self.stem}-s{seed}"


CASES: dict[str, ModelCase] = {c.name: c for c in (
    ModelCase("article_dcn", "article-dcn", "examples/article_dcn/model.py:make_model"),
    ModelCase("dlrm_v2", "dlrm-v2", "examples/dlrm_v2/model.py:make_model",
              ("--dense-lr", "0.001")),
    ModelCase("own_ranker", "own-ranker", "examples/own_ranker/model.py:make_model"),
    ModelCase("builtin", "builtin", None),
)}
DEFAULT_MODELS = tuple(CASES)


@dataclass(frozen=True)
class CheckConfig:
    """One run of the check; see the module docstring.

    Attributes:
        workdir: where checkpoints, the model store and the service's files go (the CLI
            makes a temporary folder and removes it unless ``--keep``).
        models: names of :data:`CASES`, in the order they are checked.
        steps: training steps per fit (not ``builtin``: the pipeline trains its epoch).
        batch: instances in the fixed batch (>= 2: one carries every feature's max ids,
            one only empty lists).
        seed: seed of the fixed batch (the importer checks with seed 0: another batch).
        clients: closed-loop client threads during the switch under load.
        workers: TorchServe workers each version is declared with.
        converge_timeout_s: longest wait for a version to serve (start or ``PUT /state``).
        step_timeout_s: longest run of one fit, pipeline or import subprocess.
    """

    workdir: Path
    models: tuple[str, ...] = DEFAULT_MODELS
    steps: int = 20
    batch: int = 64
    seed: int = 1
    tolerance: float = DEFAULT_TOLERANCE
    clients: int = 3
    workers: int = 1
    converge_timeout_s: float = 240.0
    step_timeout_s: float = 1800.0
    switch_seeds: tuple[int, int] = SWITCH_SEEDS

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in CASES]
        if unknown or not self.models:
            raise ConfigError(f"--examples {','.join(self.models)!r}: {unknown or 'none'} "
                              f"unknown; pick from {','.join(CASES)}")
        if len(set(self.models)) != len(self.models):
            raise ConfigError(f"--examples {','.join(self.models)!r} names a model twice")
        for name, lo in (("steps", 1), ("batch", 2), ("clients", 1), ("workers", 1)):
            int_at_least(f"--{name}", getattr(self, name), lo)
        if not (isinstance(self.tolerance, float) and self.tolerance >= 0):
            raise ConfigError(f"--tolerance {self.tolerance!r} must be a float >= 0")
        for name in ("converge_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} {getattr(self, name)!r} must be > 0")
        if len(self.switch_seeds) != 2 or self.switch_seeds[0] == self.switch_seeds[1]:
            raise ConfigError(f"switch_seeds {self.switch_seeds!r} must be two different seeds")


class StepFailed(ServeError):
    """A step of one model failed; the message says which and why (with a log excerpt)."""
