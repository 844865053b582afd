"""How busy a pod is, in the units of its own capacity: the HPA's primary signal.

Why not requests/s: a request carries 1 to 4096 instances, so a request rate is a
different amount of work for every traffic mix (measured on the CPU pod: one pod's knee
is ~6,300 req/s of single-instance requests, ~111 req/s of 100-700-instance ranking
requests). An HPA target in req/s is right for one mix only.

The work signal: every worker adds each batch's handler time (decode to response, once
per batch) to ``dlrm_capacity_work_seconds_total`` (:mod:`serve.metrics`). Its rate is
the seconds of model work the pod does per second, whatever the requests' sizes. The pod's
**available capacity** is the work rate it sustains with p99 at the goal:

    capacity = READY workers x ``busy_at_knee``  (work-seconds per second)

``busy_at_knee`` is the fraction of each worker's time spent in the handler at the knee;
the rest is queueing slack and, on a CPU pod, the cores the Java frontend takes. Measured
on the 2-core CPU pod (2 workers x 1 thread), in-process handler seconds per instance
x the knees' instances/s: ranking 0.51, mixed (loadtest/capacity.json's mix) 0.50; so
:data:`BUSY_AT_KNEE` = 0.5 (docs/autoscaling.md). Then

    utilization = rate(work_seconds_total) / capacity        (1.0 = at the knee)

and the HPA keeps it at :data:`UTILIZATION_TARGET` (0.8, the same 20% headroom the old
req/s target had). prometheus-adapter computes it (the rule serve.ops.monitoring
generates); this module holds the same arithmetic for tests and ``make hpa-sim``.

When not to trust it alone: single-instance traffic spends most of its cost outside the
handler (TorchServe's frontend and worker protocol: 0.37 utilization at that mix's knee),
so the HPA keeps a request-rate backstop at that mix's knee (k8s/hpa.yaml). During a
version switch both versions' workers count as READY for ~15 s, which halves the reading.
A GPU pod's ``busy_at_knee`` is not measured yet.

Example::

    >>> utilization_ratio(work_seconds=48.0, window_s=60.0, ready_workers=2)
    0.8
"""
from __future__ import annotations

import math

__all__ = [
    "BUSY_AT_KNEE",
    "UTILIZATION_TARGET",
    "WorkModel",
    "capacity_work_per_s",
    "utilization_ratio",
]

#: Fraction of a worker's time in the handler when the pod is at its knee (CPU pod,
#: measured 2026-12-04: ranking 0.51, mixed 0.50; see the module docstring).
BUSY_AT_KNEE = 0.5
#: The HPA's target for dlrm_capacity_utilization_ratio: 80% of the knee.
UTILIZATION_TARGET = 0.8


def capacity_work_per_s(ready_workers: float, busy_at_knee: float = BUSY_AT_KNEE) -> float:
    """Work-seconds per second a pod with ``ready_workers`` sustains at the p99 goal.

    Raises:
        ValueError: ``ready_workers`` < 0 or ``busy_at_knee`` outside (0, 1].
    """
    if not ready_workers >= 0:
        raise ValueError(f"ready_workers={ready_workers} must be >= 0")
    if not 0 < busy_at_knee <= 1:
        raise ValueError(f"busy_at_knee={busy_at_knee} must be in (0, 1]: a worker is busy "
                         "at most all of its time")
    return ready_workers * busy_at_knee


def utilization_ratio(work_seconds: float, window_s: float, ready_workers: float,
                      busy_at_knee: float = BUSY_AT_KNEE) -> float:
    """``work_seconds`` done in ``window_s`` over the pod's capacity (1.0 = its knee).

    A pod without READY workers has done no work: 0 (as the adapter's ``clamp_min``
    of the worker count to 1 makes it), never a division by zero.

    Raises:
        ValueError: ``window_s`` <= 0, ``work_seconds`` < 0, or as
            :func:`capacity_work_per_s`.
    """
    if not window_s > 0:
        raise ValueError(f"window_s={window_s} must be > 0")
    if not work_seconds >= 0:
        raise ValueError(f"work_seconds={work_seconds} must be >= 0 (a counter's increase)")
    capacity = capacity_work_per_s(max(ready_workers, 1.0), busy_at_knee)
    return work_seconds / window_s / capacity


class WorkModel:
    """Handler seconds per request of a traffic mix: ``per_request_s + per_instance_s x m``.

    ``make hpa-sim`` uses it to turn a request rate of one mix into the work rate the
    counter would show. Measured in-process on the CPU pod (2026-12-04, one thread, the
    shipped int8 ``small`` model, row-form JSON): 22.8 us per instance in ranking
    batches, 59 us per single-instance request in batches of 32.
    """

    def __init__(self, per_request_s: float, per_instance_s: float) -> None:
        if not (per_request_s >= 0 and per_instance_s >= 0) or (
                per_request_s + per_instance_s == 0):
            raise ValueError(f"per_request_s={per_request_s}, per_instance_s="
                             f"{per_instance_s}: both >= 0 and not both 0")
        self.per_request_s = float(per_request_s)
        self.per_instance_s = float(per_instance_s)

    def seconds(self, instances_per_request: float) -> float:
        """Handler seconds of one request of ``instances_per_request`` instances."""
        if not instances_per_request >= 1 or math.isinf(instances_per_request):
            raise ValueError(f"instances_per_request={instances_per_request} must be a "
                             "finite number >= 1")
        return self.per_request_s + self.per_instance_s * instances_per_request

    def __repr__(self) -> str:
        return (f"WorkModel(per_request_s={self.per_request_s!r}, "
                f"per_instance_s={self.per_instance_s!r})")
