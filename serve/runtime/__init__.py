"""The online runtime (runs in the pod, inside TorchServe's workers).

artifact (the serving file format) -> cache (embedding rows, GPU hot set) + dense (MLPs)
-> engine (:class:`serve.runtime.engine.Runtime`, one forward). Stock PyTorch only: no
TorchRec, no FBGEMM, no import of the offline build.
"""
