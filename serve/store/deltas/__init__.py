"""Embedding deltas on disk: the file format and the pod's delta store.

Lowest first (each module imports only those above it):

* :mod:`~serve.store.deltas.header`: the magic, the JSON header, its checksum and checks.
* :mod:`~serve.store.deltas.format`: :class:`~serve.store.deltas.format.Delta`, its
  encoder and its readers (in memory, mapped, scanned in chunks), the size limit.
* :mod:`~serve.store.deltas.layout`: the tables a delta must fit, and the check.
* :mod:`~serve.store.deltas.incoming`: a body being received (streamed, hashed, bounded).
* :mod:`~serve.store.deltas.status`: what each worker has applied (its status file).
* :mod:`~serve.store.deltas.files`: :class:`~serve.store.deltas.files.DeltaStore`, the
  folder the sidecar commits to and the workers follow (one chain of deltas per version).
"""
