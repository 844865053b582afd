"""The import's bounded-memory parts: a model without its tables, the tables streamed from
the checkpoint into a tables folder, and the check's model over the checked rows only.

* :func:`tables_on_meta`: while the factory runs, every allocation of at least
  ``min_bytes`` is made on the meta device (no memory): the embedding tables, whatever
  device the factory names; small tensors (non-persistent buffers such as DLRM's
  interaction indices) stay real.
* :func:`load_dense`: the checkpoint's keys and shapes checked against the model both
  ways, then only the non-table (dense) weights read into it.
* :func:`stream_tables`: each table, in the schema's order, read ``rows_per_chunk`` rows at
  a time (:mod:`serve.model.ckpt_stream`), quantized with TorchRec's arithmetic
  (:mod:`serve.model.rowquant`) and appended to a :class:`serve.store.tablefiles.TableWriter`;
  a :class:`Progress` line on stderr (rows/s, ETA) at most once a second.
* :func:`check_model`: the factory's model with each collection replaced by one holding
  only the rows the check batch reads (ids remapped to ``0 .. U-1``), so TorchRec's own
  ``quantize_inference_model`` runs on a few hundred rows instead of the tables.

Memory: the chunk's working set is at most the budget given to :func:`stream_tables`; the
model holds the dense weights; the check model a few rows per table.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from serve.errors import ConfigError
from serve.model.ckpt_stream import CheckpointSource, check_keys, row_ranges
from serve.model.export import collections
from serve.model.rowquant import quantize_chunk, rows_per_chunk
from serve.schema import ModelSchema
from serve.store.tablefiles import TableFiles, TableWriter

__all__ = ["Progress", "check_ids", "check_model", "load_dense", "remap_values",
           "stream_tables", "table_keys", "tables_on_meta"]

#: Allocations at least this large go to the meta device while the factory runs.
META_MIN_BYTES = 1 << 20
_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn, torch.full,
              torch.empty_strided, torch.randint)


def _numel(args: tuple[Any, ...], func: Any) -> int:
    if func is torch.randint:       # randint(low?, high, size)
        args = args[-1:] if args else ()
    size = args[0] if args and isinstance(args[0], tuple | list | torch.Size) else args
    n = 1
    try:
        for s in size:
            n *= int(s)
    except (TypeError, ValueError):
        return 0
    return n


class _MetaLarge(TorchFunctionMode):
    def __init__(self, min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            item = torch.empty((), dtype=dtype, device="meta").element_size()
            if _numel(args, func) * item >= self.min_bytes:
                kwargs["device"] = "meta"
                kwargs.pop("generator", None)
                kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


@contextlib.contextmanager
def tables_on_meta(min_bytes: int = META_MIN_BYTES) -> Iterator[None]:
    """Inside, tensors of at least ``min_bytes`` are created on the meta device."""
    with _MetaLarge(min_bytes):
        yield


def table_keys(model: nn.Module) -> dict[str, str]:
    """Each table's weight key in the model's state dict, by table name."""
    state = set(model.state_dict())
    out = {}
    for name, ebc in collections(model):
        for cfg in ebc.embedding_bag_configs():
            key = f"{name}.embedding_bags.{cfg.name}.weight"
            if key not in state:
                raise ConfigError(f"table {cfg.name}: its weight is not at {key} in the "
                                  "model's state dict; the contract keeps tables in "
                                  "EmbeddingBagCollection modules")
            out[cfg.name] = key
    return out


def load_dense(model: nn.Module, source: CheckpointSource, where: str) -> nn.Module:
    """Check ``source`` against ``model`` (keys and shapes, both ways) and read every
    weight but the tables into it; the tables stay as they are (meta or small).

    Raises:
        CheckpointError: a key missing or unexpected, a shape that differs.
        ConfigError: a tensor outside the tables is still on the meta device (a buffer no
            checkpoint holds: the factory must create it real).
    """
    check_keys(model, source.shapes(), where)
    tables = set(table_keys(model).values())
    dense = {k: source.read(k) for k in model.state_dict() if k not in tables}
    model.load_state_dict(dense, strict=False, assign=True)
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta and n not in tables:
            raise ConfigError(f"{n} {tuple(t.shape)} is on the meta device after loading the "
                              "checkpoint (a buffer no checkpoint holds); create it on the CPU "
                              "in the factory, or make it smaller than "
                              f"{META_MIN_BYTES} bytes")
    return model.eval()


class Progress:
    """One line on ``stream`` at most every ``every_s`` seconds: rows done of the total,
    rows/s and the ETA."""

    def __init__(self, total: int, stream: TextIO | None = None, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.stream, self.every_s, self.clock = total, stream, every_s, clock
        self.t0 = clock()
        self.last = self.t0
        self.done = 0

    def add(self, rows: int, what: str = "") -> None:
        self.done += rows
        now = self.clock()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        pct = 100.0 * self.done / max(self.total, 1)
        print(f"[tables] {self.done:,}/{self.total:,} rows ({pct:.1f}%) {what}, "
              f"{rate:,.0f} rows/s, ETA {eta:.0f} s", file=self.stream or sys.stderr,
              flush=True)


def stream_tables(source: CheckpointSource, schema: ModelSchema, keys: Mapping[str, str],
                  model: nn.Module, folder: Any, budget_bytes: int,
                  progress: Progress | None = None) -> TableFiles:
    """Write every table of ``schema`` into the new tables folder ``folder``, chunk by
    chunk, and return it opened. A chunk's working set stays within ``budget_bytes``.
    Rows are cast to the model's table dtype first (what loading them into the model
    would do), then quantized as ``quantize_inference_model`` does.
    """
    state = model.state_dict()
    with TableWriter(folder, schema.tables) as w:
        for i, spec in enumerate(schema.tables):
            key = keys[spec.name]
            want = state[key].dtype
            step = rows_per_chunk(budget_bytes, spec.dim, spec.dtype)
            for lo, hi in row_ranges(spec.rows, step):
                rows = source.read_rows(key, lo, hi)
                if rows.dtype != want:
                    rows = rows.to(want)
                w.write(i, lo, quantize_chunk(rows, spec.dtype))
                del rows
                if progress is not None:
                    progress.add(hi - lo, spec.name)
        w.commit()
    return TableFiles.open(folder)


def _feature_slices(schema: ModelSchema, lengths: torch.Tensor) -> list[tuple[int, int]]:
    per = lengths.to(torch.int64).sum(dim=1).tolist()
    out, lo = [], 0
    for n in per:
        out.append((lo, lo + int(n)))
        lo += int(n)
    return out


def check_ids(schema: ModelSchema, batches: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> dict[str, torch.Tensor]:
    """Sorted unique ids (int64 (U,)) each table is read at by ``batches`` of
    (values (nnz,), lengths (F, B)); a table nobody reads keeps row 0."""
    seen: dict[str, list[torch.Tensor]] = {t.name: [torch.zeros(0, dtype=torch.int64)]
                                           for t in schema.tables}
    for values, lengths in batches:
        for spec, (a, b) in zip(schema.features, _feature_slices(schema, lengths), strict=True):
            seen[spec.table].append(values[a:b].to(torch.int64))
    out = {}
    for name, parts in seen.items():
        u = torch.unique(torch.cat(parts))
        out[name] = u if u.numel() else torch.zeros(1, dtype=torch.int64)
    return out


def remap_values(schema: ModelSchema, values: torch.Tensor, lengths: torch.Tensor,
                 ids: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``values`` with each id replaced by its index in its table's ``ids``."""
    out = values.clone()
    for spec, (a, b) in zip(schema.features, _feature_slices(schema, lengths), strict=True):
        out[a:b] = torch.searchsorted(ids[spec.table], values[a:b].to(torch.int64))
    return out


def read_ids(source: CheckpointSource, key: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (sorted, unique) of ``key``: (U, D), runs of consecutive ids read
    together."""
    parts, i, idl = [], 0, ids.tolist()
    while i < len(idl):
        j = i
        while j + 1 < len(idl) and idl[j + 1] == idl[j] + 1:
            j += 1
        parts.append(source.read_rows(key, idl[i], idl[j] + 1))
        i = j + 1
    return torch.cat(parts)


def check_model(model: nn.Module, schema: ModelSchema, source: CheckpointSource,
                keys: Mapping[str, str], ids: Mapping[str, torch.Tensor]
                ) -> tuple[nn.Module, ModelSchema]:
    """A copy of ``model`` whose collections hold only rows ``ids[table]`` (read from the
    checkpoint, in that order), and the schema of that model (rows U per table)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    small = copy.deepcopy(model)
    for name, ebc in collections(small):
        cfgs = [dataclasses.replace(c, num_embeddings=int(ids[c.name].numel()))
                for c in ebc.embedding_bag_configs()]
        new = EmbeddingBagCollection(tables=cfgs, is_weighted=ebc.is_weighted(),
                                     device=torch.device("cpu"))
        with torch.no_grad():
            for c in cfgs:
                w = new.embedding_bags[c.name].weight
                w.copy_(read_ids(source, keys[c.name], ids[c.name]).to(w.dtype))
        parent, _, attr = name.rpartition(".")
        setattr(small.get_submodule(parent) if parent else small, attr, new)
    small_schema = dataclasses.replace(schema, tables=tuple(
        dataclasses.replace(t, rows=int(ids[t.name].numel())) for t in schema.tables))
    return small.eval(), small_schema
