"""Admission and eviction of raw ids into managed tables: the training side of dynamic
embeddings (numpy, deterministic, one process).

A **managed** table (``serve.schema.TableSpec.mapping == "managed"``) serves an id from its
own row only once the id has been admitted; any other id reads the fallback row
(:data:`serve.runtime.idmap.FALLBACK_ROW`, row 0), which training therefore makes the
"unknown id" embedding. Rows 1..rows-1 hold admitted ids: a table's capacity is
``rows - 1``. The policy engine here decides, once per day of click logs, which ids enter
and which leave; its result is one :class:`serve.runtime.idmap.IdMap` per table, which
training (ids -> rows), the artifact and the embedding deltas carry.

Per table the state tracks every id seen and not forgotten: int64 ``ids`` (n,) sorted
unique, ``count`` (n,) int64 sightings since it was last admitted or evicted (the
admission counter, carried across days), ``freq`` (n,) float64 sightings decayed by half
per day (LFU's frequency), ``last_seen`` (n,) int64 day and ``row`` (n,) int64 (0 = not
admitted). Steps, each a method testable alone:

1. :meth:`AdmissionState.observe` (day, {table: ids}): decay ``freq`` by 0.5 per day
   elapsed, add the day's sightings to ``count`` and ``freq``, set ``last_seen``;
2. :meth:`AdmissionState.decide`: per table, first the policy's expiries (``ttl`` only),
   then the candidates, ids not admitted, seen on the day and with ``count >= threshold``,
   best first: free rows go to them (ascending rows), then, the table full, each next
   candidate displaces the policy's worst resident **only if the policy ranks that
   resident below the candidate** (below);
3. :meth:`AdmissionState.id_map` / :meth:`id_maps`: the tables' maps;
4. :meth:`AdmissionState.save` / :func:`load_state`: one ``admission.npz``.

The policies (``--eviction``), with the rank that decides who goes (lower goes first) and
the displacement rule:

- ``lru``: rank = last day seen (ties: lower ``freq``, then lower id, go first). A candidate
  (seen today) displaces a resident last seen on an earlier day; never one seen today.
- ``lfu``: rank = decayed ``freq`` (ties: older ``last_seen``, then lower id). A candidate
  displaces a resident only with a strictly higher ``freq``.
- ``ttl``: an admitted id not seen for ``ttl_days`` days (``day - last_seen >= ttl_days``) is
  evicted, full table or not; nothing else is: a full table admits no one until ids expire.
- ``lfu_lru`` (the hybrid, default): ids seen within the last ``recency_days`` days
  (``day - last_seen < recency_days``) are protected; the others go lowest ``freq`` first
  (ties: older, then lower id). A candidate is itself recent, so it ranks above every
  unprotected resident and displaces it; a table whose residents are all protected admits
  no one.

Candidates are ordered best first by the same rank (then higher ``count``, then lower id).
An evicted id starts over: its ``count`` is reset, so it must be seen ``threshold`` more
times to come back. An id neither admitted nor seen for ``FORGET_DAYS`` days is dropped
from the state (bounded memory; its count is lost).

TorchRec first (checked against TorchRec 1.8.0): (a) sharding: the managed-collision
sharder offers no sharding type on CPU: ``ManagedCollisionCollectionSharder.sharding_types``
returns only ``row_wise`` (torchrec/distributed/mc_modules.py), and
``ManagedCollisionEmbeddingBagCollectionSharder().sharding_types("cpu")`` is ``[]`` (the
intersection with the EBC sharder's CPU types: data_parallel, table_wise, column_wise,
table_column_wise), so an MC-EBC cannot be placed under our CPU/gloo DMP plan at all, and
training keeps the plain sharded EBC on rows mapped here. (b) unsharded on CPU,
``MCHManagedCollisionModule`` with ``LFU_EvictionPolicy``/``LRU_EvictionPolicy`` does run
over a day's ids (``eviction_interval=1``, one forward per day), but its semantics are not
these: the threshold filter sees only the current window's counts
(``_coalesce_history``: ``threshold_filtering_func(uniq_ids_counts)`` of the history
buffer), so counts of not-yet-admitted ids are not carried across days; LFU counts only
accumulate (``mch_counts[...] += ...``), never decay; misses go to the *last* slot
(``_mch_remap(..., output_global_offset + zch_size - 1)``) and ``int64`` max is its
empty-slot sentinel (that id can never be admitted); there is no TTL (that lives in
``HashZchManagedCollisionModule``) and no recency-protected hybrid (``DistanceLFU`` blends
count and distance, it protects nothing); and the first fill is reported by ``evict()``
as evictions of every slot. We therefore use this engine for all four policies, one rule
set; tests/test_admission.py checks that on a single day with threshold 1 (where the
semantics coincide) ``lfu`` admits exactly the ids TorchRec's MCH LFU admits.

Example::

    state = AdmissionState.new(AdmissionConfig(policy="lfu_lru"), {"t_C1": 500})
    state.observe(0, {"t_C1": day0_ids})
    decisions = state.decide()
    rows = state.id_map("t_C1").lookup(torch.as_tensor(ids))
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serve.common.validate import int_at_least
from serve.errors import ConfigError

if TYPE_CHECKING:
    from serve.runtime.idmap import IdMap

__all__ = [
    "ADMISSION_FILE",
    "DEFAULT_FALLBACK_SHARE",
    "FORGET_DAYS",
    "POLICIES",
    "AdmissionConfig",
    "AdmissionState",
    "Decision",
    "TableState",
    "load_state",
    "observe_split",
    "split_counts",
]

ADMISSION_FILE = "admission.npz"
#: What a managed build reserves by default (``--fallback-share``): one fallback row per
#: table (0.0). Hashed fallback rows (a share k/rows of the rows, shared by id % k among
#: ids without a row of their own) win only where tables hold fewer rows than there are
#: ids; ``make delta-compare`` measures both regimes (docs/benchmarks/figures.md), so
#: set it per build from the ratio of ids to rows.
DEFAULT_FALLBACK_SHARE = 0.0
POLICIES = ("lru", "lfu", "ttl", "lfu_lru")
# Not-admitted ids unseen this many days are dropped from the state (bounded memory).
FORGET_DAYS = 7
_FORMAT = "admission/1"
_FIELDS = ("ids", "count", "freq", "last_seen", "row")


@dataclass(frozen=True)
class AdmissionConfig:
    """The policy of every managed table of a build (module docstring).

    Attributes:
        policy: one of :data:`POLICIES`.
        threshold: sightings before an id is admitted (>= 1).
        ttl_days: ``ttl``: days unseen before an admitted id is evicted (>= 1).
        recency_days: ``lfu_lru``: ids seen within this many days are protected (>= 1).
        fallback_share: the share of each table's rows reserved as fallback rows, which
            ids without a row of their own share by ``id % k`` (0: one fallback row).
    """

    policy: str = "lfu_lru"
    threshold: int = 2
    ttl_days: int = 2
    recency_days: int = 1
    fallback_share: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--eviction {self.policy!r} is not one of {', '.join(POLICIES)}; "
                              "lfu_lru (the default) protects recently seen ids and evicts the "
                              "least frequent of the others")
        int_at_least("--admit-threshold", self.threshold, 1,
                     then=" (sightings of an id before it gets a row of its own)")
        int_at_least("--ttl-days", self.ttl_days, 1)
        int_at_least("--recency-days", self.recency_days, 1)
        if not (isinstance(self.fallback_share, (int, float))
                and 0.0 <= self.fallback_share < 1.0):
            raise ConfigError(f"--fallback-share {self.fallback_share!r} must be in [0, 1): the "
                              "share of a table's rows that ids without a row of their own "
                              "share (0: one fallback row)")

    def fallback_rows(self, rows: int) -> int:
        """k for a table of ``rows``: round(share x rows), at least 1, at most rows - 1."""
        return min(max(1, round(self.fallback_share * rows)), rows - 1)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"policy": self.policy, "threshold": self.threshold,
                             "ttl_days": self.ttl_days, "recency_days": self.recency_days}
        if self.fallback_share:   # builds before the option keep their fingerprints
            d["fallback_share"] = self.fallback_share
        return d


@dataclass
class TableState:
    """One managed table's ids (module docstring); arrays (n,), ``ids`` sorted unique."""

    name: str
    rows: int
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    freq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    last_seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fallback_rows: int = 1

    def __post_init__(self) -> None:
        int_at_least(f"managed table {self.name}: rows", self.rows, 2,
                     then=" (row 0 is the fallback row; admitted ids need at least one more)")
        n = self.ids.shape[0]
        if any(getattr(self, f).shape != (n,) for f in _FIELDS):
            raise ConfigError(f"managed table {self.name}: state arrays of unequal lengths")

    @property
    def capacity(self) -> int:
        """Rows for admitted ids: ``rows - fallback_rows`` (rows 0..k-1 are the fallback)."""
        return self.rows - self.fallback_rows

    @property
    def admitted(self) -> int:
        return int((self.row > 0).sum())

    def _take(self, keep: np.ndarray) -> None:
        for f in _FIELDS:
            setattr(self, f, getattr(self, f)[keep])


@dataclass(frozen=True)
class Decision:
    """One table's change of one :meth:`AdmissionState.decide`: int64 sorted ids."""

    admitted: np.ndarray
    evicted: np.ndarray

    def to_dict(self) -> dict[str, int]:
        return {"admitted": int(self.admitted.shape[0]), "evicted": int(self.evicted.shape[0])}


class AdmissionState:
    """The admission state of a build's managed tables (module docstring).

    ``day`` is the last day observed (-1: none yet); ``tables`` in schema order.
    """

    def __init__(self, config: AdmissionConfig, tables: list[TableState], day: int = -1) -> None:
        self.config = config
        self.tables = {t.name: t for t in tables}
        self.day = day
        # What the last decide() did, per table (not saved: a report of the run).
        self.last_decisions: dict[str, Decision] = {}

    @classmethod
    def new(cls, config: AdmissionConfig, rows: Mapping[str, int]) -> AdmissionState:
        """An empty state for tables ``{name: rows}``: nothing admitted."""
        return cls(config, [TableState(n, int(r), fallback_rows=config.fallback_rows(int(r)))
                            for n, r in rows.items()])

    def table(self, name: str) -> TableState:
        try:
            return self.tables[name]
        except KeyError:
            raise ConfigError(f"admission state has no managed table {name!r} "
                              f"(it has {', '.join(self.tables)})") from None

    # ------------------------------------------------------------------ step 1: observe
    def observe(self, day: int, seen: Mapping[str, np.ndarray | tuple[np.ndarray, np.ndarray]]
                ) -> None:
        """Count a day's sightings: ``{table: ids int64 (k,)}`` (any order, repeats count)
        or ``{table: (unique ids, counts)}``. Decays every ``freq`` by 0.5 per day since the
        last observed day first. Tables not named saw nothing that day.

        Raises:
            ConfigError: ``day`` is not after the last observed day, an unknown table, or a
                negative id.
        """
        int_at_least("admission day", day, 0)
        if day <= self.day:
            raise ConfigError(f"admission day {day} is not after the last observed day "
                              f"{self.day}; observe each day once, in order")
        unknown = sorted(set(seen) - set(self.tables))
        if unknown:
            raise ConfigError(f"admission: {unknown} are not managed tables "
                              f"({', '.join(self.tables)})")
        decay = 0.5 ** (day - self.day) if self.day >= 0 else 1.0
        for name, t in self.tables.items():
            t.freq = t.freq * decay
            if name not in seen:
                continue
            v = seen[name]
            if isinstance(v, tuple):
                uniq, cnt = np.asarray(v[0], np.int64), np.asarray(v[1], np.int64)
            else:
                uniq, cnt = np.unique(np.asarray(v, np.int64), return_counts=True)
            if uniq.size and int(uniq.min()) < 0:
                raise ConfigError(f"admission: table {name} saw a negative id {int(uniq.min())}; "
                                  "raw ids are >= 0")
            _merge(t, uniq, cnt.astype(np.int64), day)
        self.day = day

    # ------------------------------------------------------------------ step 2: decide
    def decide(self) -> dict[str, Decision]:
        """Apply the policy for the last observed day: expire, admit, evict (module
        docstring); return each table's admitted and evicted ids.

        Raises:
            ConfigError: nothing observed yet.
        """
        if self.day < 0:
            raise ConfigError("admission: decide() before any observe(); nothing was seen")
        self.last_decisions = {name: self._decide_table(t) for name, t in self.tables.items()}
        return dict(self.last_decisions)

    def _decide_table(self, t: TableState) -> Decision:
        cfg, day = self.config, self.day
        evicted: list[np.ndarray] = []
        if cfg.policy == "ttl":
            expired = np.flatnonzero((t.row > 0) & (day - t.last_seen >= cfg.ttl_days))
            evicted.append(t.ids[expired])
            t.row[expired] = 0
            t.count[expired] = 0
        cand = np.flatnonzero((t.row == 0) & (t.last_seen == day) & (t.count >= cfg.threshold))
        cand = cand[self._order(t, cand, best_first=True)]
        used = np.zeros(t.rows, dtype=bool)
        used[:t.fallback_rows] = True
        used[t.row[t.row > 0]] = True
        free = np.flatnonzero(~used)
        n_free = min(free.shape[0], cand.shape[0])
        t.row[cand[:n_free]] = free[:n_free]
        admitted = [cand[:n_free]]
        rest = cand[n_free:]
        if rest.size and cfg.policy != "ttl":
            newly = np.zeros(t.ids.shape[0], dtype=bool)
            newly[cand[:n_free]] = True
            residents = np.flatnonzero((t.row > 0) & ~newly)
            if cfg.policy == "lfu_lru":  # protected: seen within recency_days
                residents = residents[day - t.last_seen[residents] >= cfg.recency_days]
            victims = residents[self._order(t, residents, best_first=False)]
            k = 0
            for c, v in zip(rest, victims, strict=False):
                if not self._outranks(t, int(c), int(v)):
                    break  # candidates only get worse and victims only better from here
                t.row[c], t.row[v] = t.row[v], 0
                t.count[v] = 0
                k += 1
            admitted.append(rest[:k])
            evicted.append(t.ids[victims[:k]])
        adm = np.sort(t.ids[np.concatenate(admitted)]) if admitted else np.zeros(0, np.int64)
        t.count[np.searchsorted(t.ids, adm)] = 0  # admitted: the counter starts over
        ev = np.sort(np.concatenate(evicted)) if evicted else np.zeros(0, np.int64)
        self._forget(t)
        return Decision(adm.astype(np.int64), ev.astype(np.int64))

    def _order(self, t: TableState, idx: np.ndarray, best_first: bool) -> np.ndarray:
        """Positions sorting ``idx`` by the policy's rank, worst first (or best first)."""
        p = self.config.policy
        if p in ("lru", "ttl"):
            keys = [t.last_seen[idx], t.freq[idx]]
        else:  # lfu, lfu_lru (its victims are already the unprotected ones)
            keys = [t.freq[idx], t.last_seen[idx]]
        if best_first:  # best: high rank, then high count, then low id
            order = np.lexsort((t.ids[idx], -t.count[idx], -keys[1], -keys[0]))
        else:  # worst: low rank, then low id
            order = np.lexsort((t.ids[idx], keys[1], keys[0]))
        return order

    def _outranks(self, t: TableState, c: int, v: int) -> bool:
        """Whether candidate position ``c`` may displace resident position ``v``."""
        p = self.config.policy
        if p == "lru":
            return bool(t.last_seen[c] > t.last_seen[v])
        if p == "lfu":
            return bool(t.freq[c] > t.freq[v])
        return p == "lfu_lru"  # v is unprotected (checked), c was seen today

    def _forget(self, t: TableState) -> None:
        keep = (t.row > 0) | (self.day - t.last_seen < FORGET_DAYS)
        if not keep.all():
            t._take(keep)

    # ------------------------------------------------------------------ step 3: maps
    def id_map(self, name: str) -> IdMap:
        """Table ``name``'s admitted ids -> rows as a :class:`serve.runtime.idmap.IdMap`."""
        from serve.runtime.idmap import IdMap

        t = self.table(name)
        on = t.row > 0
        return IdMap.from_arrays(t.ids[on].copy(), t.row[on].copy(), t.rows, t.fallback_rows)

    def id_maps(self) -> dict[str, IdMap]:
        return {name: self.id_map(name) for name in self.tables}

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per table: admitted ids, capacity (rows - 1) and occupancy (admitted / capacity)."""
        return {n: {"admitted": t.admitted, "capacity": t.capacity,
                    "occupancy": round(t.admitted / t.capacity, 6)}
                for n, t in self.tables.items()}

    # ------------------------------------------------------------------ step 4: file
    def save(self, path: str | os.PathLike) -> Path:
        """Write the state as one ``.npz`` (atomically); returns the path."""
        path = Path(path)
        meta = {"format": _FORMAT, "config": self.config.to_dict(), "day": self.day,
                "tables": [{"name": t.name, "rows": t.rows, "fallback_rows": t.fallback_rows}
                           for t in self.tables.values()]}
        arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(meta))}
        for i, t in enumerate(self.tables.values()):
            for f in _FIELDS:
                arrays[f"t{i}_{f}"] = getattr(t, f)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
        return path


def load_state(path: str | os.PathLike) -> AdmissionState:
    """An :class:`AdmissionState` saved by :meth:`AdmissionState.save`.

    Raises:
        ConfigError: the file is missing or not an admission state.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"admission state {path} does not exist; a managed build writes it "
                          f"next to its checkpoint ({ADMISSION_FILE})")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("format") != _FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            tables = [TableState(str(m["name"]), int(m["rows"]),
                                 **{f: z[f"t{i}_{f}"].copy() for f in _FIELDS},
                                 fallback_rows=int(m.get("fallback_rows", 1)))
                      for i, m in enumerate(meta["tables"])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"admission state {path} is unreadable ({e}); rebuild it (a managed "
                          "build or delta writes it)") from None
    return AdmissionState(AdmissionConfig(**meta["config"]), tables, int(meta["day"]))


def _merge(t: TableState, uniq: np.ndarray, cnt: np.ndarray, day: int) -> None:
    """Add sightings (``uniq`` sorted unique, ``cnt``) of ``day`` into ``t``."""
    if not uniq.size:
        return
    ids = np.union1d(t.ids, uniq)
    if ids.shape[0] != t.ids.shape[0]:
        pos = np.searchsorted(ids, t.ids)
        grown = {}
        for f, dt in (("count", np.int64), ("freq", np.float64), ("last_seen", np.int64),
                      ("row", np.int64)):
            a = np.zeros(ids.shape[0], dt)
            if f == "last_seen":
                a[:] = -1
            a[pos] = getattr(t, f)
            grown[f] = a
        t.ids, t.count, t.freq = ids, grown["count"], grown["freq"]
        t.last_seen, t.row = grown["last_seen"], grown["row"]
    at = np.searchsorted(t.ids, uniq)
    t.count[at] += cnt
    t.freq[at] += cnt
    t.last_seen[at] = day


# ----------------------------------------------------------------------------- data

def split_counts(data_dir: str | os.PathLike, split: str = "train",
                 feature_tables: Mapping[str, str] | None = None,
                 chunk_rows: int = 1 << 20) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every id of a data split counted, per table: ``{table: (ids int64 sorted unique,
    counts int64)}``; padding beyond a sample's length is not counted. Reads the whole
    split, so every rank computes the same counts.

    ``feature_tables``: feature -> table name (default: ``t_<feature>``, the built-in
    DLRM's one table per feature); features mapped to the same table are counted together.
    """
    from serve.model.data import load_split

    d = load_split(data_dir, split)
    tables = feature_tables or {f: f"t_{f}" for f in d.feature_names}
    acc: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    n = len(d)
    for j, f in enumerate(d.feature_names):
        if f not in tables:
            continue
        parts = acc.setdefault(tables[f], [])
        for lo in range(0, n, chunk_rows):
            ids = np.asarray(d.sparse[lo:lo + chunk_rows, j, :], dtype=np.int64)
            if d.lengths is not None:
                m = ids.shape[1]
                ln = np.asarray(d.lengths[lo:lo + chunk_rows, j])
                ids = ids[np.arange(m)[None, :] < ln[:, None]]
            parts.append(np.unique(ids.reshape(-1), return_counts=True))
    return {t: _sum_counts(p) for t, p in acc.items()}


def _sum_counts(parts: Iterable[tuple[np.ndarray, np.ndarray]]
                ) -> tuple[np.ndarray, np.ndarray]:
    parts = list(parts)
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
    cnt = np.concatenate([p[1] for p in parts]).astype(np.int64)
    uniq, inv = np.unique(ids, return_inverse=True)
    return uniq, np.bincount(inv, weights=cnt, minlength=uniq.shape[0]).astype(np.int64)


def observe_split(state: AdmissionState, day: int, data_dir: str | os.PathLike,
                  split: str = "train", feature_tables: Mapping[str, str] | None = None
                  ) -> dict[str, Decision]:
    """Observe a day's split (:func:`split_counts`) for the state's tables and decide."""
    counts = split_counts(data_dir, split, feature_tables)
    state.observe(day, {t: c for t, c in counts.items() if t in state.tables})
    return state.decide()
