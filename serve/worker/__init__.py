"""What runs in a TorchServe worker process, without TorchServe.

* :mod:`~serve.worker.worker`: :class:`Worker` composes the parts below;
  ``Worker.load`` once per process, ``Worker.handle`` once per batch.
* :mod:`~serve.worker.arms`: :class:`~serve.worker.arms.Arms`, the runtimes (stable and a
  rollout's candidate) and the rollout split; ``handle_batch`` decodes a batch with
  :mod:`serve.api` and runs ONE merged forward per arm.
* :mod:`~serve.worker.recording`: the handler metrics and the prediction log of each batch.
* :mod:`~serve.worker.deltas`: the batch guard and the delta followers.
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
