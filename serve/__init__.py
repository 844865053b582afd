"""DLRM serving: pipeline (data, train, merge, quantize, archive), runtime, cache, sidecar.

Importing this package imports neither TorchServe nor TorchRec; each module pulls
what it needs.
"""
