"""The embedding-delta parts the sidecar wires (:mod:`serve.sidecar.root`), as one value
the routes receive: each part owns its state; this record owns nothing."""
from __future__ import annotations

from dataclasses import dataclass

from serve.sidecar.services.deltas.intake import DeltaIntake
from serve.sidecar.services.deltas.progress import WorkerProgress
from serve.sidecar.services.deltas.report import DeltaReport
from serve.sidecar.services.deltas.volume import VolumeSync
from serve.store.deltas.files import DeltaStore

__all__ = ["DeltaParts"]


@dataclass(frozen=True)
class DeltaParts:
    """The pod's delta store and the four parts around it.

    Attributes:
        store: the pod's delta store (``--delta-dir``), shared with the workers.
        intake: checks and stores a delta (POST /embeddings/deltas, the volume).
        volume: picks up the deltas published on the model volume, through ``intake``.
        progress: the live workers and what they applied (waits, readiness).
        report: summaries, damaged files and the Prometheus families.
    """

    store: DeltaStore
    intake: DeltaIntake
    volume: VolumeSync
    progress: WorkerProgress
    report: DeltaReport
