"""Embedding deltas on disk: the file format and the pod's delta store
(:mod:`~serve.store.deltas.format`)."""
