"""Sparse ids -> global rows of the concatenated tables, and the per-feature id counters.

Shapes: F sparse features, B batch, nnz ids of a batch (feature-major), F_g features of
one :class:`FeatureGroup`. A global row is the table's offset plus the table's row of the
id: ``id % rows`` for a modulo table (ids >= rows wrap: counted per feature as
"wrapped"), the version's id map for a managed one (:mod:`serve.runtime.idmap`: ids not
in the map read the fallback row 0, counted per feature as "fallback").

:class:`RowMapper` owns the feature groups, the managed tables' id maps (a
:class:`serve.runtime.idmap.MapIndex`) and both counters; the table store
(:mod:`serve.runtime.tables`) asks it for the rows of a batch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from serve.errors import ConfigError
from serve.runtime.idmap import IdMap, MapIndex
from serve.schema import ModelSchema

__all__ = ["FeatureGroup", "RowMapper"]


@dataclass
class FeatureGroup:
    """Features whose tables share a row format (dtype, dim) and a pooling: embedded by one
    gather, one dequantization and one pooling. A model of one dim, dtype and pooling (our
    built-in DLRM) is one group of every feature, in order.

    Tensors on the runtime's device unless ``_h``; F_g = len(features).
    """

    features: tuple[int, ...]       # feature indices, request order
    dtype: str
    dim: int
    mode: str                       # "sum" | "mean" (F.embedding_bag's mode)
    rows_d: torch.Tensor            # int64 (F_g,) rows of each feature's table
    offsets_d: torch.Tensor         # int64 (F_g,) global row of each feature's table
    ids_d: torch.Tensor             # arange(F_g)
    features_d: torch.Tensor        # int64 (F_g,) = features (for per-feature counters)
    rows_h: torch.Tensor            # int64 (F_g, 1) on the host
    modulo_d: torch.Tensor          # int64 (F_g,) 1 where the feature's table is modulo
    managed: tuple[tuple[int, int], ...]   # (j in the group, table) of managed features
    managed_j: torch.Tensor                # int64 (M,) the j of ``managed``
    managed_f: torch.Tensor                # int64 (M,) their feature indices
    managed_tables: tuple[int, ...]        # (M,) their tables
    scratch: torch.Tensor | None = None    # float32 dequantization buffer, reused


def _make_groups(schema: ModelSchema, table_rows: list[int], offsets: list[int],
                 managed_tables: dict[int, int], dev: torch.device) -> list[FeatureGroup]:
    """One :class:`FeatureGroup` per (dtype, dim, pooling), in order of first feature."""
    ftab = schema.feature_tables
    keyed: dict[tuple[str, int, str], list[int]] = {}
    for f, t in enumerate(ftab):
        spec = schema.tables[t]
        keyed.setdefault((spec.dtype, spec.dim, spec.pooling), []).append(f)
    groups = []
    for (dtype, dim, pooling), feats in keyed.items():
        rows = [table_rows[ftab[f]] for f in feats]
        managed = tuple((j, ftab[f]) for j, f in enumerate(feats) if ftab[f] in managed_tables)
        groups.append(FeatureGroup(
            tuple(feats), dtype, dim, pooling,
            torch.tensor(rows, dtype=torch.int64, device=dev),
            torch.tensor([offsets[ftab[f]] for f in feats], dtype=torch.int64, device=dev),
            torch.arange(len(feats), device=dev),
            torch.tensor(feats, dtype=torch.int64, device=dev),
            torch.tensor(rows, dtype=torch.int64).unsqueeze(1),
            torch.tensor([0 if ftab[f] in managed_tables else 1 for f in feats],
                         dtype=torch.int64, device=dev),
            managed,
            torch.tensor([j for j, _ in managed], dtype=torch.int64, device=dev),
            torch.tensor([feats[j] for j, _ in managed], dtype=torch.int64, device=dev),
            tuple(t for _, t in managed)))
    return groups


class RowMapper:
    """Global rows of a batch's ids, group by group, counting wrapped and fallback ids.

    Args:
        schema: the model's tables and features.
        table_rows: rows per table (``schema.tables`` order).
        offsets: global row of each table's row 0 (tables concatenated in order).
        map_index: the managed tables' id maps (``map_index.tables``: table -> rows; empty
            without managed tables), where the rows are served from.
        device: where the rows are computed and the counters kept.
    """

    def __init__(self, schema: ModelSchema, table_rows: list[int], offsets: list[int],
                 map_index: MapIndex, device: torch.device) -> None:
        self.device = device
        self.table_rows = table_rows
        #: Managed tables (index -> rows); their maps are in ``map_index``.
        self.managed: dict[int, int] = dict(map_index.tables)
        self.map_index = map_index
        self.groups = _make_groups(schema, table_rows, offsets, self.managed, device)
        self.single = len(self.groups) == 1
        nf = len(schema.feature_tables)
        self._wrapped_d = torch.zeros(nf, dtype=torch.int64, device=device)
        # The CUDA-graph path (one group) counts wrapped ids on the host (the graph wraps
        # them itself): :meth:`count_wrapped_host`.
        self._wrapped_h = torch.zeros(nf, dtype=torch.int64)
        self._fallback_d = torch.zeros(nf, dtype=torch.int64, device=device)

    def global_rows(self, g: FeatureGroup, values: torch.Tensor, lengths: torch.Tensor,
                    one_hot: bool) -> torch.Tensor:
        """int64 (nnz_g,) global rows on the device of one group's ids: offset[f] + id % rows[f].

        Computed on the device (``output_size`` avoids a sync): at batch 32768 the
        host-side version cost milliseconds per batch. One-hot batches broadcast per
        feature instead: CPU ``repeat_interleave`` opens a thread-parallel region even
        for 26 elements, which stalled batch-1 calls for milliseconds on a busy host.
        """
        dev = self.device
        v = values.to(dev, non_blocking=True).long()
        if one_hot:
            vv = v.view(len(g.features), -1)
            if len(g.managed) == len(g.features):   # every table managed: no wraps, no %
                local, found = self.map_index.lookup_features(vv, g.managed_tables)
                if self.single:
                    self._fallback_d += (~found).sum(1)
                else:
                    self._fallback_d.index_add_(0, g.managed_f, (~found).sum(1))
                return (local + g.offsets_d.unsqueeze(1)).view(-1)
            rows = g.rows_d.unsqueeze(1)
            wrapped = (vv >= rows).sum(1)
            if g.managed:
                wrapped.mul_(g.modulo_d)
            if self.single:
                self._wrapped_d += wrapped
            else:
                self._wrapped_d.index_add_(0, g.features_d, wrapped)
            local = vv % rows
            if g.managed:
                got, found = self.map_index.lookup_features(
                    vv.index_select(0, g.managed_j), g.managed_tables)     # (M, B)
                local.index_copy_(0, g.managed_j, got)
                self._fallback_d.index_add_(0, g.managed_f, (~found).sum(1))
            return (local + g.offsets_d.unsqueeze(1)).view(-1)
        per_feature = lengths.sum(1).to(dev, non_blocking=True)
        feat = torch.repeat_interleave(g.ids_d, per_feature, output_size=v.numel())
        rows = g.rows_d.index_select(0, feat)
        over = (v >= rows).long()
        if g.managed:
            over.mul_(g.modulo_d.index_select(0, feat))
        self._wrapped_d.index_add_(0, feat if self.single else g.features_d.index_select(0, feat),
                                   over)
        local = v % rows
        if g.managed:
            bounds = [0, *itertools.accumulate(lengths.sum(1).tolist())]
            for j, t in g.managed:   # few multi-hot features: one lookup each
                lo, hi = bounds[j], bounds[j + 1]
                if hi > lo:
                    got, found = self.map_index.lookup(v[lo:hi], [(t, 0, hi - lo)])
                    local[lo:hi] = got
                    self._fallback_d[g.features[j]] += (~found).sum()
        return local + g.offsets_d.index_select(0, feat)

    def count_wrapped_host(self, values: torch.Tensor) -> None:
        """Count the wrapped ids of a one-hot batch of the one group on the host (the CUDA
        graph wraps them itself). ``values``: int64 (F * B,) on the CPU, feature-major."""
        g = self.groups[0]
        self._wrapped_h += (values.view(len(g.features), -1) >= g.rows_h).sum(1)

    # -- the managed tables' id maps ------------------------------------------------------
    def changed_id_map(self, table: int, assign_ids: torch.Tensor, assign_rows: torch.Tensor,
                       evict_ids: torch.Tensor) -> IdMap:
        """Table ``table``'s map after a delta's changes, without changing it (so a delta's
        every change is checked before any is applied)."""
        if table not in self.managed:
            raise ConfigError(f"table {table} is not one of the managed tables "
                              f"{sorted(self.managed)}; only managed tables take id changes")
        return self.map_index.map(table).apply(assign_ids, assign_rows, evict_ids)

    def set_id_map(self, table: int, id_map: IdMap) -> None:
        """Serve ``id_map`` for managed table ``table`` from the next batch on (written in
        place: with the pod-wide shared tables every worker sees it)."""
        if table not in self.managed or id_map.table_rows != self.table_rows[table]:
            raise ConfigError(f"table {table} is not a managed table of {id_map.table_rows} "
                              "rows")
        self.map_index.write(table, id_map)

    @property
    def id_maps(self) -> dict[int, IdMap]:
        """The managed tables' maps (table index -> map; views, valid until the next
        change)."""
        return {t: self.map_index.map(t) for t in self.managed}

    @property
    def id_probe(self) -> str | None:
        """How the managed maps are probed (:attr:`MapIndex.probe`); None without managed
        tables."""
        return self.map_index.probe if self.managed else None

    # -- counters -------------------------------------------------------------------------
    def wrapped(self) -> tuple[int, ...]:
        """Per feature, ids >= their modulo table's rows so far (one device sync)."""
        return tuple(int(x) for x in (self._wrapped_d.cpu() + self._wrapped_h).tolist())

    def fallback(self) -> tuple[int, ...]:
        """Per feature, managed-table ids not in the map so far (one device sync)."""
        return tuple(int(x) for x in self._fallback_d.cpu().tolist())
