"""One model build's settings (:class:`PipelineConfig`) and where it works
(:func:`default_workdir`): what :mod:`serve.model.pipeline` builds from, validated once."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve.common.validate import boolean, int_at_least
from serve.constants import DENSE_PRECISIONS
from serve.errors import ConfigError
from serve.model.admission import DEFAULT_FALLBACK_SHARE
from serve.profiles import Profile
from serve.schema import MAPPINGS
from serve.state import DEFAULT_BATCH_SIZE, DEFAULT_MAX_BATCH_DELAY_MS, DEFAULT_WORKERS, VERSION_RE
from serve.store.repository import (
    MANAGED_SUFFIX,
    SHUFFLED_SUFFIX,
    ModelRepository,
    day_suffix,
    default_version,
)

__all__ = ["MAPPING_CHOICES", "PipelineConfig", "default_workdir"]

MAPPING_CHOICES = MAPPINGS  # serve.schema: "modulo", "managed"


def default_workdir(profile_name: str, seed: int, label_shuffle: bool = False,
                    data_day: int = 0, mapping: str = "modulo") -> Path:
    """One build directory per (profile, seed, shuffle, day, mapping): ``build/small-s0``,
    or ``build/small-s8-shuffled`` with ``--label-shuffle`` (never the normal seed's
    checkpoints), ``build/small-s0-day1`` on day 1's data, ``build/small-s0-managed`` with
    ``--mapping managed``."""
    return Path("build") / (f"{profile_name}-s{seed}{SHUFFLED_SUFFIX if label_shuffle else ''}"
                            f"{day_suffix(data_day)}"
                            f"{MANAGED_SUFFIX if mapping == 'managed' else ''}")


@dataclass(frozen=True)
class PipelineConfig:
    """One model build. ``None`` fields take the profile's value.

    ``seed`` is the training seed (initial weights; the data always uses the profile's
    seed); ``version`` names the model version the build adds to ``model_store``
    (default :func:`default_version`). ``label_shuffle`` trains on the training split's
    labels permuted with the training seed (a model with eval AUC ~0.5; the int8 quality
    bar is then not applied, see :attr:`quality_check`).
    """

    profile: Profile
    workdir: Path
    model_store: Path = Path("model_store")
    model_name: str = "dlrm"
    seed: int | None = None
    version: str | None = None
    nproc: int = 2
    backend: str = "auto"
    dtype: str = "int8"
    alpha: float | None = None
    samples: int | None = None
    eval_samples: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    threads: int = 1
    num_workers: int = 1
    # The shipped batching (serve.state says why: 2 requests, merged only when queued).
    mar_batch_size: int = DEFAULT_BATCH_SIZE
    mar_max_batch_delay_ms: int = DEFAULT_MAX_BATCH_DELAY_MS
    # Workers x threads must fit the cores: one thread per worker lets one worker parse
    # JSON while another runs a forward (2 x 1 beat 1 x 2 by ~2x at 512 instances/request).
    mar_workers: int = DEFAULT_WORKERS
    handler_config: dict[str, Any] = field(default_factory=dict)
    force: bool = False
    check_quality: bool = True
    label_shuffle: bool = False
    data_day: int = 0     # day of the click logs (serve.model.data; 0 = the original)
    # Id space of every table: "modulo" (row = id % rows) or "managed" (admitted ids get
    # rows, the others the fallback row; serve.model.admission). The rest: its policy.
    mapping: str = "modulo"
    admit_threshold: int = 2
    eviction: str = "lfu_lru"
    ttl_days: int = 2
    recency_days: int = 1
    fallback_share: float = DEFAULT_FALLBACK_SHARE
    # The dense part's arithmetic (serve.constants.DENSE_PRECISIONS): fp32 (exact), or a
    # lossy lever the archive step admits only through its AUC gate (serve.model.precision).
    dense_precision: str = "fp32"
    # Merge and quantize streamed from the checkpoint (serve.model.stream_build): True,
    # False (the in-memory path), or None: when the fp32 tables exceed half of the budget.
    stream: bool | None = None
    # Memory the streamed steps may hold beyond the interpreter (None: the importer's
    # DEFAULT_MAX_MEMORY_BYTES, 2 GB); it also decides ``stream=None``.
    max_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        from serve.model.quantize import QUANT_DTYPES

        if self.mapping not in MAPPING_CHOICES:
            raise ConfigError(f"--mapping {self.mapping!r} must be one of "
                              f"{', '.join(MAPPING_CHOICES)} (modulo: row = id % rows; managed: "
                              "admitted ids get rows of their own)")
        _ = self.admission  # validates the policy settings

        if self.dense_precision not in DENSE_PRECISIONS:
            raise ConfigError(f"--dense-precision {self.dense_precision!r} must be one of "
                              f"{', '.join(DENSE_PRECISIONS)}")
        if "dense_precision" in self.handler_config:
            raise ConfigError("handler_config.dense_precision: set it with --dense-precision, "
                              "which runs the AUC gate")
        if self.dtype not in QUANT_DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} must be one of {', '.join(QUANT_DTYPES)}")
        if self.nproc < 1:
            raise ConfigError(f"--nproc {self.nproc} must be >= 1")
        if self.seed is not None:
            int_at_least("--seed", self.seed, 0)
        boolean("label_shuffle", self.label_shuffle,
                then="; pass --label-shuffle to permute the training labels, or omit it")
        int_at_least("--data-day", self.data_day, 0, then=" (0 = the original click logs)")
        self._check_stream()
        if not re.fullmatch(VERSION_RE, self.version_name):
            raise ConfigError(
                f"--version {self.version_name!r} is not a valid version name: use letters, "
                "digits, '.' and '-' (no '_', it separates a version from its batching suffix), "
                f"starting with a letter or digit, at most 64 characters ({VERSION_RE})")

    def _check_stream(self) -> None:
        from serve.model.importer import MIN_MAX_MEMORY_BYTES

        if self.stream is not None:
            boolean("stream", self.stream, then="; pass --stream, --no-stream, or neither "
                    "(streamed when the fp32 tables exceed half of --max-memory-bytes)")
        if self.max_memory_bytes is not None:
            int_at_least("--max-memory-bytes", self.max_memory_bytes, MIN_MAX_MEMORY_BYTES,
                         then=f" ({MIN_MAX_MEMORY_BYTES} = 16 MiB; default 2000000000)")
        if not self.streamed:
            return
        why = ("--stream" if self.stream else
               f"its fp32 tables ({self.profile.table_bytes_fp32():,} B) exceed half of "
               f"--max-memory-bytes {self.memory_budget:,}")
        if self.mapping != "modulo":
            raise ConfigError(f"--mapping {self.mapping}: this build streams ({why}), and the "
                              "streamed build takes modulo id spaces only; build it with "
                              "--mapping modulo, or in memory (--no-stream, a larger "
                              "--max-memory-bytes)")
        if self.dense_precision != "fp32":
            raise ConfigError(f"--dense-precision {self.dense_precision}: this build streams "
                              f"({why}), and the streamed build serves the dense part in fp32 "
                              "only; drop --dense-precision, or build in memory (--no-stream)")

    @property
    def memory_budget(self) -> int:
        """``max_memory_bytes``, or the importer's default (2 GB)."""
        from serve.model.importer import DEFAULT_MAX_MEMORY_BYTES

        return DEFAULT_MAX_MEMORY_BYTES if self.max_memory_bytes is None else self.max_memory_bytes

    @property
    def streamed(self) -> bool:
        """Whether merge and quantize stream (:mod:`serve.model.stream_build`): ``stream``,
        or when None, whether the fp32 tables exceed half of the memory budget (the
        in-memory path holds them about twice over)."""
        if self.stream is not None:
            return self.stream
        return self.profile.table_bytes_fp32() > self.memory_budget // 2

    @property
    def stream_artifact(self) -> Path:
        """A streamed build's format-3 artifact (its tables: :attr:`stream_tables`)."""
        return self.workdir / "artifact.stream.pt"

    @property
    def stream_tables(self) -> Path:
        """A streamed build's tables folder, named as the repository stores it."""
        return self.workdir / self.repository.tables_name(self.version_name)

    @property
    def admission(self) -> Any:
        """The :class:`serve.model.admission.AdmissionConfig` of a managed build; None
        for modulo."""
        from serve.model.admission import AdmissionConfig

        if self.mapping != "managed":
            return None
        return AdmissionConfig(policy=self.eviction, threshold=self.admit_threshold,
                               ttl_days=self.ttl_days, recency_days=self.recency_days,
                               fallback_share=self.fallback_share)

    @property
    def train_seed(self) -> int:
        return self.profile.seed if self.seed is None else self.seed

    @property
    def version_name(self) -> str:
        if self.version is not None:
            return self.version
        return default_version(self.profile.name, self.dtype, self.train_seed, self.label_shuffle,
                               self.data_day, self.mapping, self.dense_precision)

    @property
    def quality_check(self) -> bool:
        """Whether the quantize step enforces the int8 AUC bar: ``check_quality``, except
        for a label-shuffled build, whose AUC ~0.5 makes the fp32/int8 gap noise."""
        return self.check_quality and not self.label_shuffle

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoint"

    @property
    def merged(self) -> Path:
        return self.workdir / "merged.pt"

    @property
    def artifact(self) -> Path:
        return self.workdir / "artifact.pt"

    @property
    def mar(self) -> Path:
        """The archive as built in the work directory (the repository gets a copy)."""
        return self.workdir / f"{self.model_name}-{self.version_name}.mar"

    @property
    def repository(self) -> ModelRepository:
        return ModelRepository([self.model_store], self.model_name)
