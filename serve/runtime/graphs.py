"""A whole predict as one CUDA-graph replay, captured once per batch size.

Shapes: B batch, F sparse features, N dense features. Only one-hot batches of a model of
one feature group without managed tables (:meth:`serve.runtime.tables.TableStore.static_ok`)
take this path; the runtime runs every other batch eagerly. Inputs go through pinned host
buffers so each needs one async copy; the wrap rule (id % rows + offset) runs inside the
graph on static per-position tensors, and with a cache its fixed-shape lookup
(:meth:`serve.runtime.cache.EmbeddingCache.lookup_static`) is captured too.
"""
from __future__ import annotations

import logging

import torch

from serve.runtime.tables import TableStore

__all__ = ["GraphRunner"]

log = logging.getLogger(__name__)

#: A captured CUDA graph for one batch size and its buffers: the graph, its static
#: inputs (ids, dense) and output on the device, and the pinned host copies of all three.
_GraphEntry = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor, torch.Tensor, torch.Tensor]


class GraphRunner:
    """Captures and replays whole predicts of one runtime, one graph per batch size.

    Args:
        store: the runtime's table store (rows of a batch, and its counters).
        dense: the dense part, ``(x (B, N), emb (B, F, D)) -> logits (B,)``.
        dense_dtype: what the dense part computes in (float32 or bfloat16).
        num_dense: N.
        device: the runtime's CUDA device; every call runs under its device guard.
    """

    def __init__(self, store: TableStore, dense: torch.nn.Module, dense_dtype: torch.dtype,
                 num_dense: int, device: torch.device) -> None:
        self.store, self.dense, self.dense_dtype = store, dense, dense_dtype
        self.num_dense, self.device = num_dense, device
        self.nf = len(store.schema.feature_tables)
        #: Batch size -> its captured graph and buffers.
        self.captured: dict[int, _GraphEntry] = {}
        self._capture_stream: torch.cuda.Stream | None = None

    def fits(self, values: torch.Tensor, lengths: torch.Tensor, b: int) -> bool:
        """Whether a validated batch (values (nnz,), lengths (F, B)) can replay a graph:
        one id per feature, and a store that serves ``F * B`` ids at fixed shapes."""
        n = self.nf * b
        return self.store.static_ok(n) and values.numel() == n and bool((lengths == 1).all())

    def predict(self, dense: torch.Tensor, values: torch.Tensor, b: int) -> torch.Tensor:
        """(B,) float32 probabilities on the CPU of one graph replay (captured first for a
        new ``b``). Called under the runtime's device guard, so the copies and the replay
        go to this device's current stream."""
        entry = self.captured.get(b)
        if entry is None:
            entry = self._capture(b)
            self.captured[b] = entry
        graph, s_vals, s_dense, s_out, h_vals, h_dense, h_out = entry
        h_vals.copy_(values)
        h_dense.copy_(dense)
        s_vals.copy_(h_vals, non_blocking=True)
        s_dense.copy_(h_dense, non_blocking=True)
        graph.replay()
        h_out.copy_(s_out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        # The graph wraps ids itself: count them (and, without a cache, the lookups) here.
        self.store.count_static(values)
        return h_out.clone()

    def body(self, vals: torch.Tensor, dense: torch.Tensor, rows_rep: torch.Tensor,
             offs_rep: torch.Tensor, b: int) -> torch.Tensor:
        """What the graph records: ids (F * B,) and dense (B, N) on the device -> (B,)
        float32 probabilities (``rows_rep``, ``offs_rep``: ``store.static_positions(b)``).
        Plain tensor code: the tests run it eagerly on CPU."""
        emb = self.store.embed_static(vals, rows_rep, offs_rep, b)
        return torch.sigmoid(self.dense(dense.to(self.dense_dtype),
                                        emb.to(self.dense_dtype)).float())

    def _capture(self, b: int) -> _GraphEntry:
        """Capture :meth:`body` for batch ``b`` on a side stream of this runtime's device.

        The stream is explicit: ``torch.cuda.graph``'s default capture stream is created
        once per process on whichever device was current, so a runtime on cuda:1 would
        otherwise capture nothing of its own kernels.
        """
        dev = self.device
        rows_rep, offs_rep = self.store.static_positions(b)   # (F*B,) per position
        s_vals = torch.zeros((self.nf * b,), dtype=torch.int64, device=dev)
        s_dense = torch.zeros((b, self.num_dense), dtype=torch.float32, device=dev)
        # Warm-up runs really look up (row 0 of each table): keep the counters exact.
        cache = self.store.cache
        saved = cache.tally.save() if cache is not None else None
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm up kernels/allocator outside the capture
                self.body(s_vals, s_dense, rows_rep, offs_rep, b)
        torch.cuda.current_stream(dev).wait_stream(stream)
        if cache is not None and saved is not None:
            cache.tally.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            s_out = self.body(s_vals, s_dense, rows_rep, offs_rep, b)
        h_vals = torch.empty((self.nf * b,), dtype=torch.int64, pin_memory=True)
        h_dense = torch.empty((b, self.num_dense), dtype=torch.float32, pin_memory=True)
        h_out = torch.empty((b,), dtype=torch.float32, pin_memory=True)
        log.info("captured a CUDA graph for batch %d", b)
        return graph, s_vals, s_dense, s_out, h_vals, h_dense, h_out

    def clear(self) -> None:
        """Drop every captured graph (before the cache's host table is released: a graph
        with the cache step reads it on replay)."""
        self.captured.clear()
