"""Model/data profiles: typed, validated configs selected by name, and the schema of a
version from its build report (:func:`schema_from_report`: the recorded one, else its profile's).

Shapes used across the package: B = batch size, F = number of sparse features
(26 here), D = embedding dim, N = number of dense features (13).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serve.errors import ConfigError, UnknownProfileError
from serve.schema import DEFAULT_MAX_IDS, ModelSchema, criteo_schema

__all__ = [
    "BUILTIN_MAX_IDS",
    "CRITEO_KAGGLE_CARDINALITIES",
    "DENSE_FEATURES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "PROFILES",
    "SPARSE_FEATURES",
    "Profile",
    "get_profile",
    "schema_from_report",
]

NUM_DENSE = 13
#: Most ids per feature and instance that the built-in DLRM's requests may carry.
BUILTIN_MAX_IDS = DEFAULT_MAX_IDS
NUM_SPARSE = 26
DENSE_FEATURES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_FEATURES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))

# The 26 categorical cardinalities of the Criteo Kaggle display-advertising data set,
# as used by the DLRM reference; they sum to 33,762,577 rows.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)


@dataclass(frozen=True)
class Profile:
    """One model + data configuration.

    Attributes:
        cardinalities: rows of each of the F tables, in SPARSE_FEATURES order.
        embedding_dim: D; also the last layer of ``dense_arch``.
        dense_arch: bottom MLP layer sizes (input N).
        over_arch: top MLP layer sizes; the last must be 1 (a logit).
        train_samples / eval_samples: rows of generated click logs.
        large_table_rows: tables with more rows than this are sharded column-wise on
            CPU and row-wise on GPU; smaller ones table-wise.
        zipf_alpha: default skew of generated ids (Zipf exponent, > 0).
        max_ids_per_feature: generated multi-hot length is 1..this (1 = one-hot).
        id_cardinalities: the ids the click logs draw from, per feature (None: the
            tables' rows, every id has a row). Larger than ``cardinalities`` when the
            tables are smaller than the id universe, as in production, where user and
            item ids outnumber the rows memory allows: then ``mapping`` decides which
            ids share a row (modulo) or get one (managed, :mod:`serve.runtime.idmap`).
        hashed_ids: the click logs carry each id as a 63-bit hash of it
            (:func:`serve.model.data.hash_ids`, a per-feature bijection), as production
            logs carry user and item ids and Criteo its categories (32-bit hashes),
            instead of 0..n-1. ``id % rows`` then folds ids into rows at random from day
            0 on (about 37% of a table's ids share their row when it has as many rows as
            ids), where dense ids fill a table exactly.
    """

    name: str
    cardinalities: tuple[int, ...]
    embedding_dim: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    train_samples: int
    eval_samples: int
    batch_size: int
    epochs: int
    learning_rate: float
    large_table_rows: int
    zipf_alpha: float = 1.05
    max_ids_per_feature: int = 1
    seed: int = 0
    feature_names: tuple[str, ...] = field(default=SPARSE_FEATURES)
    id_cardinalities: tuple[int, ...] | None = None
    hashed_ids: bool = False
    #: The user-side sparse features: what a ranking request sends once, as its context,
    #: with the dense vector (the load generator's declaration; the model does not care).
    #: Built in: C1..C13 (Criteo's features are anonymous; half is the declared split).
    context_features: tuple[str, ...] = field(default=SPARSE_FEATURES[:13])

    def __post_init__(self) -> None:
        if len(self.cardinalities) != len(self.feature_names):
            raise ConfigError(
                f"profile {self.name!r}: {len(self.cardinalities)} cardinalities for "
                f"{len(self.feature_names)} features; give one per feature")
        if any(c < 1 for c in self.cardinalities):
            raise ConfigError(f"profile {self.name!r}: every cardinality must be >= 1")
        if self.dense_arch[-1] != self.embedding_dim:
            raise ConfigError(
                f"profile {self.name!r}: dense_arch ends with {self.dense_arch[-1]} but "
                f"embedding_dim is {self.embedding_dim}; they must be equal")
        if self.over_arch[-1] != 1:
            raise ConfigError(f"profile {self.name!r}: over_arch must end with 1 (a logit)")
        if self.zipf_alpha <= 0:
            raise ConfigError(f"profile {self.name!r}: zipf_alpha {self.zipf_alpha} must be > 0")
        stray = sorted(set(self.context_features) - set(self.feature_names))
        if stray:
            raise ConfigError(f"profile {self.name!r}: context features {stray} are not "
                              "among its feature_names")

    @property
    def id_space(self) -> tuple[int, ...]:
        """Ids per feature in the click logs (0..n-1 on day 0): ``id_cardinalities`` or the
        tables' rows."""
        return self.id_cardinalities or self.cardinalities

    @property
    def num_sparse(self) -> int:
        return len(self.feature_names)

    @property
    def total_rows(self) -> int:
        return sum(self.cardinalities)

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(f"t_{f}" for f in self.feature_names)

    def table_bytes_fp32(self) -> int:
        return self.total_rows * self.embedding_dim * 4

    def schema(self, dtype: str = "int8", max_ids: int = BUILTIN_MAX_IDS) -> ModelSchema:
        """The request schema and tables of this profile's DLRM stored as ``dtype``."""
        return criteo_schema(self.feature_names, self.cardinalities, self.embedding_dim,
                             dtype, NUM_DENSE, max_ids)


_SMALL = Profile(
    name="small",
    cardinalities=tuple(min(c, 100_000) for c in CRITEO_KAGGLE_CARDINALITIES),
    embedding_dim=64, dense_arch=(512, 256, 64), over_arch=(512, 256, 1),
    # batch 4096 / lr 0.1: 2.4x the rows/s of batch 1024 on 2 CPU ranks (the MLP
    # GEMMs amortise per-step overhead), AUC 0.877 vs 0.878; trains in ~70 s.
    train_samples=1_000_000, eval_samples=100_000, batch_size=4096, epochs=1,
    learning_rate=0.1, large_table_rows=50_000,
)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="tiny",
            cardinalities=tuple(min(c, 500) for c in CRITEO_KAGGLE_CARDINALITIES),
            embedding_dim=16, dense_arch=(32, 16), over_arch=(32, 16, 1),
            train_samples=20_000, eval_samples=4_000, batch_size=256, epochs=1,
            learning_rate=0.05, large_table_rows=400,
        ),
        _SMALL,
        # small's click logs, tables of half as many rows: the regime managed ids are for
        # (bench.delta_compare compares modulo and managed on it and on small).
        dataclasses.replace(
            _SMALL, name="small-half",
            cardinalities=tuple(max(1, (c + 1) // 2) for c in _SMALL.cardinalities),
            id_cardinalities=_SMALL.cardinalities),
        # small's click logs with every id a 63-bit hash of it (as raw logs carry them):
        # modulo folds ids at random from day 0 on; bench.delta_compare compares on it.
        dataclasses.replace(_SMALL, name="small-hashed", hashed_ids=True),
        Profile(
            name="criteo-kaggle",
            cardinalities=CRITEO_KAGGLE_CARDINALITIES,
            embedding_dim=64, dense_arch=(512, 256, 64), over_arch=(512, 256, 1),
            train_samples=200_000, eval_samples=50_000, batch_size=1024, epochs=1,
            learning_rate=0.05, large_table_rows=1_000_000,
        ),
    )
}


def get_profile(name: str) -> Profile:
    """Return the named profile; raise UnknownProfileError listing the valid names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfileError(
            f"profile {name!r} does not exist; choose one of: {', '.join(PROFILES)}") from None


def schema_from_report(report: Mapping[str, Any]) -> ModelSchema:
    """The schema of a version from its build report: the ``schema`` it records (imports
    and builds since format 2), else the built-in DLRM of its ``profile`` and
    ``quantized_dtype`` (older builds).

    Raises:
        ConfigError: the report has neither (a foreign or broken build).
    """
    if "schema" in report:
        return ModelSchema.from_dict(report["schema"])
    try:
        return get_profile(str(report["profile"])).schema(str(report["quantized_dtype"]))
    except KeyError as e:
        raise ConfigError(f"build report of version {report.get('version')!r} has no schema "
                          f"and no {e} to derive it from; rebuild or re-import it") from e
