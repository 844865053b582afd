"""The HTTP body contract of ``POST /predictions/dlrm`` (runs in the pod).

:mod:`serve.api.protocol` parses and validates request bodies (row, columnar and binary
forms) and encodes responses; the TorchServe handler only adapts it.
"""
