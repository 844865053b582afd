"""The online runtime (runs in the pod, inside TorchServe's workers).

- ``artifact``: the serving file format; ``dense``: the dense part (MLPs).
- ``engine``: :class:`serve.runtime.engine.Runtime`, loading, input checks, the dense
  forward and the delta entry points; it asks its table store for the rows of a batch.
- ``tables``: :class:`serve.runtime.tables.TableStore`, where the rows live (device
  table, the pod-wide ``shared`` tables, or the cache) and the pooled embeddings of a
  batch; its hit ratios are its metrics. ``rowmap``: ids -> global rows (modulo rule,
  managed tables' ``idmap``).
- ``cache``: the GPU hot set (slot index and policy, counters) over ``hostmem`` (every
  row in page-locked host memory, and the miss path).
- ``graphs``: whole predicts replayed as CUDA graphs; ``follower``: embedding deltas,
  applied between batches; ``warmup``: kernels built before traffic.

Stock PyTorch only: no TorchRec, no FBGEMM, no import of the offline build.
"""
