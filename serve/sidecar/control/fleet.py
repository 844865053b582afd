"""One rollout decision per fleet, recorded where every pod (and a restarted one) reads it.

Without this each pod judges its own traffic and keeps its outcome in memory: two pods can
decide differently, and a restarted sidecar bakes a rolled-back candidate again. Here:

* one pod is the **leader** (it holds a :class:`Lease`; a pod without a fleet is its own
  leader): only it evaluates the rollout's guards, over the **fleet's** traffic (its own
  metric families plus every peer sidecar's ``GET /metrics``, :class:`FleetFamilies`);
* its decision (or a ``POST /state/rollout/promote|rollback`` on any pod) is a
  :class:`RolloutDecision` written to a :class:`DecisionStore`, **first writer wins**;
* every pod's reconcile pass reads the store for the declared rollout and adopts the
  recorded decision (:meth:`serve.sidecar.control.rollout.RolloutController.adopt`); a pod
  that starts while a decided rollout is still declared is born decided, so a
  rolled-back candidate is never registered again.

The records and the local implementations (files under ``.run/``, ``make fleet``) are in
:mod:`serve.sidecar.adapters.fleet_store`: :class:`FileDecisionStore`,
:class:`FileLease` (both under ``fcntl.flock``), :class:`FilePeers` (``.run/fleet.json``).
Kubernetes ones: :mod:`serve.sidecar.adapters.kubernetes`.

When not to use the file ones: across machines (``flock`` is local; NFS locks are not to be
trusted for this).

Example::

    fleet = Fleet("pod-a", lease=FileLease(Path(".run/rollout-lease.json")),
                  decisions=FileDecisionStore(Path(".run/rollout-decisions.json")))
    fleet.elect()              # every reconcile pass: acquire or renew the lease
    fleet.leading              # True: this pod ticks the guards
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from serve.errors import ConfigError
from serve.metrics import FLEET_LEADER, FLEET_PODS, FLEET_PODS_JUDGED
from serve.sidecar.adapters.fleet_store import DecisionStore, Lease, Peer, PeerSource

__all__ = ["Fleet", "FleetFamilies"]

_log = logging.getLogger(__name__)

#: How long a peer's GET /metrics may take before it is skipped (seconds): the leader's
#: guard period is seconds, and one slow pod must not stall the judgement of the others.
PEER_TIMEOUT_S = 1.0


def _get_text(url: str, timeout_s: float) -> str:
    r = httpx.get(url, timeout=timeout_s)
    r.raise_for_status()
    return r.text


class FleetFamilies:
    """The leader's ``read_families``: its own families plus every peer sidecar's ``GET
    /metrics`` (public port), parsed. The guards' snapshot sums samples with equal labels
    across families, so the concatenation is the fleet's sums.

    A peer that does not answer within ``timeout_s`` is skipped (named in
    :attr:`skipped`); its last answer is counted instead, so a window's counts never go
    backwards because a pod was slow once (a pod that never answered counts nothing).

    Args:
        own: this pod's families (``HandlerAggregateCollector.collect``).
        peers: the fleet's pods.
        identity: this pod's name (skipped in ``peers``).
        timeout_s: per peer.
        get: ``(url, timeout_s) -> text`` (tests pass a fake).
    """

    def __init__(self, own: Callable[[], Iterable[Metric]], peers: PeerSource, identity: str,
                 *, timeout_s: float = PEER_TIMEOUT_S,
                 get: Callable[[str, float], str] = _get_text) -> None:
        self.own = own
        self.source = peers
        self.identity = identity
        self.timeout_s = timeout_s
        self.get = get
        self._last: dict[str, list[Metric]] = {}
        self.judged: int = 1
        self.pods: int = 1
        self.skipped: dict[str, str] = {}

    def _scrape(self, peer: Peer) -> list[Metric]:
        text = self.get(f"{peer.sidecar_url}/metrics", self.timeout_s)
        return list(text_string_to_metric_families(text))

    def __call__(self) -> list[Metric]:
        families = list(self.own())
        try:
            others = [p for p in self.source.peers() if p.name != self.identity]
        except (ConfigError, OSError) as e:
            _log.warning("listing the fleet's pods failed (%s); judging this pod alone", e)
            others = []
        skipped: dict[str, str] = {}
        if others:
            with ThreadPoolExecutor(max_workers=min(8, len(others))) as pool:
                futures = [(p, pool.submit(self._scrape, p)) for p in others]
                for peer, fut in futures:
                    try:
                        self._last[peer.name] = fut.result()
                    except Exception as e:  # noqa: BLE001 - any failure: skip this pod
                        skipped[peer.name] = f"{type(e).__name__}: {e}"[:200]
        for peer in others:
            families += self._last.get(peer.name, [])
        self.pods = len(others) + 1
        self.judged = self.pods - len(skipped)
        self.skipped = skipped
        return families

    def describe(self) -> str:
        """``pods_judged: 2 of 3 (skipped pod-c: ...)``."""
        text = f"pods_judged: {self.judged} of {self.pods}"
        if self.skipped:
            text += " (skipped " + "; ".join(f"{n}: {why}" for n, why in
                                            sorted(self.skipped.items())) + ")"
        return text


# --------------------------------------------------------------------------- the fleet


class Fleet(Collector):
    """This pod's place in the fleet: its identity, the lease, the decision store and the
    fleet-wide families; also the ``dlrm_fleet_*`` metrics (register it in the sidecar's
    registry).

    Args:
        identity: this pod's name (POD_NAME in Kubernetes; the pod's name locally).
        lease: None: this pod is its own leader (a single pod, no fleet).
        decisions: where decisions are recorded.
        families: the fleet-wide families the leader judges (None: its own only).
        publish_state: records a settled desired state in the fleet's own object, where
            the state file is read-only (Kubernetes: ``settled-state.yaml`` of the
            decisions ConfigMap, never the operator's ``dlrm-serving-state``); None:
            nowhere (the local state file is written by the reconciler itself).
        renew_every_s: :meth:`elect` asks the lease at most this often (0: every call,
            i.e. every reconcile pass); a third of the lease's duration keeps an API
            server's load to a few calls per pod per lease period, and a leader renews
            well before it expires.
        clock: monotonic seconds (for ``renew_every_s``).
    """

    def __init__(self, identity: str, *, decisions: DecisionStore, lease: Lease | None = None,
                 families: FleetFamilies | None = None,
                 publish_state: Callable[[str], bool] | None = None,
                 renew_every_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not identity:
            raise ConfigError("a fleet identity (pod name) must be non-empty: set POD_NAME "
                              "or pass --fleet-identity")
        self.identity = identity
        self.lease = lease
        self.decisions = decisions
        self.families = families
        self.publish_state = publish_state
        self.leading = lease is None
        self.leader: str | None = identity if lease is None else None
        self.error: str | None = None
        self.renew_every_s = renew_every_s
        self.clock = clock
        self._asked: float | None = None
        # The pass and the sidecar's renewal loop both elect (each on a thread): one at a
        # time, or this pod's two updates of the Lease race each other (a 409: "lost").
        self._electing = threading.Lock()

    def elect(self) -> bool:
        """Acquire or renew the lease (each reconcile pass and the sidecar's renewal loop,
        one at a time, at most every ``renew_every_s``); True when this pod leads.
        A lease that cannot be reached is not held (no pod judges rather than two)."""
        if self.lease is None:
            self.leading, self.leader, self.error = True, self.identity, None
            return True
        with self._electing:
            now = self.clock()
            if self._asked is not None and now - self._asked < self.renew_every_s:
                return self.leading
            self._asked = now
            return self._ask(self.lease)

    def _ask(self, lease: Lease) -> bool:
        try:
            self.leading = lease.try_acquire(self.identity)
            self.leader = self.identity if self.leading else lease.holder()
            self.error = None
        except Exception as e:  # noqa: BLE001 - an unreachable lease: follow, retry next pass
            if self.leading:
                _log.warning("the rollout lease could not be renewed (%s); following", e)
            self.leading, self.leader, self.error = False, None, f"lease: {e}"[:300]
        return self.leading

    def status(self) -> dict[str, Any]:
        """``fleet`` in GET /state: identity, leader, leading, pods judged (a read)."""
        fam = self.families
        return {"identity": self.identity, "leader": self.leader, "leading": self.leading,
                "lease": "none (single pod: its own leader)" if self.lease is None
                else type(self.lease).__name__,
                "pods": fam.pods if fam is not None else 1,
                "pods_judged": fam.judged if fam is not None else 1,
                "skipped": dict(fam.skipped) if fam is not None else {},
                "error": self.error}

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(FLEET_LEADER, "1 when this pod holds the rollout lease (it "
                                            "judges the fleet's guards), else 0.")
        g.add_metric([], 1.0 if self.leading else 0.0)
        yield g
        fam = self.families
        pods = GaugeMetricFamily(FLEET_PODS, "Pods of the fleet the leader knows of "
                                             "(itself included) at its last judgement.")
        pods.add_metric([], float(fam.pods if fam is not None else 1))
        yield pods
        judged = GaugeMetricFamily(FLEET_PODS_JUDGED, "Pods whose metrics answered at the "
                                                      "leader's last judgement.")
        judged.add_metric([], float(fam.judged if fam is not None else 1))
        yield judged
