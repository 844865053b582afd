"""The delta folders of versions no longer served are deleted: :func:`clean_versions`.

A version's folder (its deltas, the workers' statuses and the shared ``tables.bin``)
stays while the version is served or still registered with TorchServe, and while a live
worker reports in it (it still maps its table); the sidecar calls this every sync
interval (``Sidecar.clean_deltas``), never while TorchServe does not answer.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from serve.store.deltas.files import DeltaStore

__all__ = ["clean_versions", "model_versions"]

_log = logging.getLogger(__name__)

# A TorchServe serving version: <version>_b<batch>d<delay>w<workers>[_c<candidate>].
_SERVING = re.compile(r"^(?P<v>.+?)_b\d+d\d+w\d+(?:_c(?P<c>.+))?$")


def clean_versions(store: DeltaStore, keep: Iterable[str], live_pids: Iterable[int]
                   ) -> list[str]:
    """Delete the folder (deltas, statuses, ``tables.bin``) of every version in ``store``
    that is not in ``keep`` (served or still registered) and that no live worker reports
    in (a worker of it still maps its table); drop bodies left half-received by a dead
    process. Returns the versions removed (blocking I/O)."""
    keep, pids = set(keep), set(live_pids)
    removed = []
    for version in store.versions():
        if version in keep or store.worker_statuses(version, sorted(pids)):
            continue
        held = store.remove_version(version)
        removed.append(version)
        _log.info("delta folder of version %s removed (%d bytes): it is no longer "
                  "served and no live worker maps it", version, held)
    store.drop_stale_incoming()
    return removed


def model_versions(serving_version: str) -> list[str]:
    """The repository versions a TorchServe serving version loads (its model version and
    a rollout's candidate): ``small-s0_b2d2w2_csmall-s7`` -> ``[small-s0, small-s7]``; a
    foreign name is taken as a version itself."""
    m = _SERVING.fullmatch(serving_version)
    if m is None:
        return [serving_version]
    return [m.group("v")] + ([m.group("c")] if m.group("c") else [])
