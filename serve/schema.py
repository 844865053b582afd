"""The model's schema: what a request must carry and how each feature reaches a table.

It travels with the model (artifact format 2, and the version's build report), so the
request decoders, the runtime, the sidecar's ``GET /state`` and the rollout's checks all
read the served model's schema instead of a constant. Pure Python (no torch): the sidecar
reads it from the build report.

Shapes: N dense features, F sparse features (in request / KeyedJaggedTensor order), T
tables (T <= F: several features may read one table), D_t the dim of table t.

A feature reads exactly one table; a table may be read by several features (TorchRec's
``EmbeddingBagConfig.feature_names``). Pooling belongs to the table, as in TorchRec.
``max_ids`` is the most ids one instance may carry in the feature (1 = one-hot).

Example::

    s = ModelSchema(dense=2,
                    tables=(TableSpec("t_item", rows=1000, dim=16),),
                    features=(FeatureSpec("item_id", "t_item", 1),
                              FeatureSpec("history", "t_item", 20)))
    s.describe()  # {"dense": 2, "sparse": [{"name": "item_id", "table": "t_item", ...}, ...]}
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serve.common.validate import int_at_least
from serve.errors import ConfigError
from serve.rowformat import DTYPES

__all__ = ["DEFAULT_MAX_IDS", "MAPPINGS", "POOLINGS", "FeatureSpec", "ModelSchema", "TableSpec",
           "criteo_schema"]

POOLINGS = ("sum", "mean")
#: How a table turns a raw id into a row: ``modulo`` (row = id % rows: ids beyond the
#: table share rows with others) or ``managed`` (the version's id map,
#: :class:`serve.runtime.idmap.IdMap`: admitted ids own a row, the rest get the table's
#: fallback row 0).
MAPPINGS = ("modulo", "managed")
#: Most ids per feature and instance when a build states none (format-1 artifacts; the
#: handler's only limit before schemas).
DEFAULT_MAX_IDS = 64
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}$")
_NAME_RULE = "names are 1-128 characters: a letter or '_', then letters, digits, '_', '.', '-'"


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise ConfigError(f"{what}={v!r} is not a valid name; {_NAME_RULE}")
    return v


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: rows x dim, stored as ``dtype`` (serve.rowformat), pooled by
    ``pooling`` ("sum" or "mean"), its ids turned into rows by ``mapping`` (:data:`MAPPINGS`)."""

    name: str
    rows: int
    dim: int
    pooling: str = "sum"
    dtype: str = "int8"
    mapping: str = "modulo"
    #: Managed tables: rows 0..k-1 that ids outside the id map share by ``id % k``.
    fallback_rows: int = 1

    def __post_init__(self) -> None:
        _name(self.name, "table name")
        int_at_least(f"table {self.name}: rows", self.rows, 1)
        int_at_least(f"table {self.name}: dim", self.dim, 1)
        if self.pooling not in POOLINGS:
            raise ConfigError(f"table {self.name}: pooling {self.pooling!r} is not one of "
                              f"{POOLINGS}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"table {self.name}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.dtype == "int4" and self.dim % 2:
            raise ConfigError(f"table {self.name}: int4 needs an even dim, got {self.dim}; "
                              "store it as int8")
        if self.mapping not in MAPPINGS:
            raise ConfigError(f"table {self.name}: mapping {self.mapping!r} is not one of "
                              f"{MAPPINGS}")
        if self.mapping == "managed" and self.rows < 2:
            raise ConfigError(f"table {self.name}: a managed table needs >= 2 rows (row 0 is "
                              f"the fallback for ids not admitted), got {self.rows}")
        if not isinstance(self.fallback_rows, int) or self.fallback_rows < 1 \
                or (self.fallback_rows > 1 and (self.mapping != "managed"
                                                or self.fallback_rows >= self.rows)):
            raise ConfigError(f"table {self.name}: fallback_rows {self.fallback_rows!r} must be "
                              f"1, or for a managed table 1..{self.rows - 1}")

    def to_dict(self) -> dict[str, Any]:
        """The mapping is written only when managed: modulo schemas (every build before
        managed ids) keep their exact dict, so reports and fingerprints do not change."""
        d: dict[str, Any] = {"name": self.name, "rows": self.rows, "dim": self.dim,
                             "pooling": self.pooling, "dtype": self.dtype}
        if self.mapping != "modulo":
            d["mapping"] = self.mapping
        if self.fallback_rows != 1:
            d["fallback_rows"] = self.fallback_rows
        return d


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature of a request: its name, the table it reads, its most ids."""

    name: str
    table: str
    max_ids: int = 1

    def __post_init__(self) -> None:
        _name(self.name, "feature name")
        int_at_least(f"feature {self.name}: max_ids", self.max_ids, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "table": self.table, "max_ids": self.max_ids}


@dataclass(frozen=True)
class ModelSchema:
    """The request schema and the table layout of one model version.

    Attributes:
        dense: N, dense features per instance (>= 0).
        tables: the T tables, in storage order (global rows are laid out in this order).
        features: the F sparse features, in request order.
    """

    dense: int
    tables: tuple[TableSpec, ...]
    features: tuple[FeatureSpec, ...]

    def __post_init__(self) -> None:
        int_at_least("dense", self.dense, 0)
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "features", tuple(self.features))
        if not self.tables or not self.features:
            raise ConfigError("a model needs at least one embedding table and one sparse "
                              f"feature; got {len(self.tables)} tables and "
                              f"{len(self.features)} features")
        tnames = [t.name for t in self.tables]
        fnames = [f.name for f in self.features]
        for what, names in (("table", tnames), ("feature", fnames)):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ConfigError(f"{what} names must be unique; repeated: {dup}")
        known = set(tnames)
        for f in self.features:
            if f.table not in known:
                raise ConfigError(f"feature {f.name} reads table {f.table!r}, which is not "
                                  f"one of the tables {tnames}")
        unread = [t for t in tnames if t not in {f.table for f in self.features}]
        if unread:
            raise ConfigError(f"tables {unread} are read by no feature; every table needs one")

    # -- lookups -------------------------------------------------------------------------
    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise ConfigError(f"table {name!r} is not one of {list(self.table_names)}")

    @property
    def feature_tables(self) -> tuple[int, ...]:
        """For each feature (request order), the index of the table it reads."""
        idx = {t.name: i for i, t in enumerate(self.tables)}
        return tuple(idx[f.table] for f in self.features)

    @property
    def max_ids(self) -> tuple[int, ...]:
        return tuple(f.max_ids for f in self.features)

    @property
    def pooled_dim(self) -> int:
        """Sum over features of their table's dim: the width of the pooled embeddings."""
        return sum(self.tables[t].dim for t in self.feature_tables)

    @property
    def total_rows(self) -> int:
        return sum(t.rows for t in self.tables)

    # -- views ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The request-facing view (``GET /state`` ``observed.model.schema``):
        ``{"dense": N, "sparse": [{"name", "table", "rows", "dim", "pooling", "max_ids"}]}``,
        plus ``"mapping": "managed"`` for a feature whose table is managed."""
        tables = {t.name: t for t in self.tables}
        out = []
        for f in self.features:
            t = tables[f.table]
            d: dict[str, Any] = {"name": f.name, "table": f.table, "rows": t.rows, "dim": t.dim,
                                 "pooling": t.pooling, "max_ids": f.max_ids}
            if t.mapping != "modulo":   # as in to_dict: modulo views stay as they were
                d["mapping"] = t.mapping
            out.append(d)
        return {"dense": self.dense, "sparse": out}

    def to_dict(self) -> dict[str, Any]:
        return {"dense": self.dense, "tables": [t.to_dict() for t in self.tables],
                "features": [f.to_dict() for f in self.features]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSchema:
        """Inverse of :meth:`to_dict`; a malformed mapping is a ``ConfigError`` naming it."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"a model schema is a mapping, got {type(d).__name__}")
        try:
            tables = tuple(TableSpec(**t) for t in d["tables"])
            features = tuple(FeatureSpec(**f) for f in d["features"])
            return cls(dense=d["dense"], tables=tables, features=features)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"model schema is malformed ({type(e).__name__}: {e}); it "
                              "needs dense, tables [{name, rows, dim, pooling, dtype[, mapping]}] and "
                              "features [{name, table, max_ids}]") from e

    def request_differences(self, other: ModelSchema) -> list[str]:
        """What a client sending requests for ``self`` would get wrong against ``other``:
        dense count, feature names and order, max ids per feature (empty: the same
        requests serve both). Table layout may differ freely (rows, dims, dtypes)."""
        out: list[str] = []
        if self.dense != other.dense:
            out.append(f"dense features: {self.dense} vs {other.dense}")
        if self.feature_names != other.feature_names:
            a, b = set(self.feature_names), set(other.feature_names)
            if a == b:
                out.append(f"sparse feature order: {list(self.feature_names)} vs "
                           f"{list(other.feature_names)}")
            else:
                if a - b:
                    out.append(f"sparse features only in the first: {sorted(a - b)}")
                if b - a:
                    out.append(f"sparse features only in the second: {sorted(b - a)}")
        mine = dict(zip(self.feature_names, self.max_ids, strict=True))
        for f, m in zip(other.feature_names, other.max_ids, strict=True):
            if f in mine and mine[f] != m:
                out.append(f"max_ids of {f}: {mine[f]} vs {m}")
        return out


def criteo_schema(feature_names: Sequence[str], cardinalities: Sequence[int], dim: int,
                  dtype: str, num_dense: int, max_ids: int) -> ModelSchema:
    """One sum-pooled table ``t_<feature>`` per feature (our built-in DLRM's layout)."""
    tables = tuple(TableSpec(f"t_{f}", int(r), dim, "sum", dtype)
                   for f, r in zip(feature_names, cardinalities, strict=True))
    features = tuple(FeatureSpec(f, f"t_{f}", max_ids) for f in feature_names)
    return ModelSchema(num_dense, tables, features)
