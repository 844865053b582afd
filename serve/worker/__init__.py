"""What runs in a TorchServe worker process, without TorchServe.

* :mod:`~serve.worker.worker`: :class:`Worker` owns the runtimes (stable and a rollout's
  candidate), the rollout split, the delta followers, the prediction log and the
  metrics; ``Worker.load`` once per process, ``Worker.handle`` once per batch.
* :mod:`~serve.worker.messages`: :class:`WorkerRequest` in, :class:`WorkerResponse` out,
  and the ``X-DLRM-*`` headers every response carries.

``handlers/dlrm_handler.py`` adapts it to TorchServe; nothing here imports ``handlers``.
"""
from serve.worker.messages import (
    BATCH_INSTANCES_HEADER,
    BATCH_REQUESTS_HEADER,
    MODEL_VERSION_HEADER,
    TS_BATCH_HEADER,
    WorkerRequest,
    WorkerResponse,
)
from serve.worker.worker import Worker, model_version, runtime_config, worker_device

__all__ = [
    "BATCH_INSTANCES_HEADER",
    "BATCH_REQUESTS_HEADER",
    "MODEL_VERSION_HEADER",
    "TS_BATCH_HEADER",
    "Worker",
    "WorkerRequest",
    "WorkerResponse",
    "model_version",
    "runtime_config",
    "worker_device",
]
