"""``POST /embeddings/deltas`` (bearer token): add an embedding delta and wait until the
workers apply it; ``GET /embeddings/deltas``: per served version, the deltas stored and
what each live worker has applied.

The body of the POST is the delta file as written by ``make delta`` (any Content-Type;
:data:`serve.store.deltas.format.DELTA_MEDIA_TYPE` is the proper one). The checks and their answers
are in :mod:`serve.sidecar.services.deltas.intake`: 413 too large, 400 damaged or not fitting the
version's tables (``field`` names the part), 409 for a version not served here or a
sequence that is not the next one; nothing is stored on any of them. The body streams
into a file of the store (never held in memory). The same bytes posted again are stored
once and answered like the first post; the right bytes posted for a stored sequence whose
file is damaged (the GET names it under ``damaged``) replace it. A stored delta
answers 200 once every live worker serving its version reports it applied, or 202 when
``wait_s`` passes first (it stays stored; the workers still apply it, in order).

A sidecar started without ``--delta-dir`` answers the POST with 409 saying how to turn
deltas on, and the GET with ``enabled: false``.

Each delta names its parent (``parent_digest``): a delta built on another delta than the
one this pod holds is refused with 409 (``reason`` ``parent_mismatch``, both digests in
the body); the GET shows per version ``head_digest``, the parent the next delta must name.

A sidecar started with ``--deltas-post refuse`` (a pod of a fleet: Kubernetes) answers
the POST with 409 (``reason`` ``volume_only``) naming where to publish instead, the model
volume every pod follows (``publish_to``), and reads no byte of the body: a delta posted
to one pod would live in that pod only.
"""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from serve.errors import Conflict, DeltaConflict, ServeError
from serve.settings import DLRM_DELTA_DIR
from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import (
    DamagedDelta,
    DeltaAnswer,
    DeltasStatus,
    DeltaWorker,
    EmbeddingsStatus,
)
from serve.sidecar.root import Sidecar, SidecarDep
from serve.sidecar.services.deltas.intake import Accepted, DeltaIntake, refusal_reason
from serve.sidecar.services.deltas.parts import DeltaParts
from serve.sidecar.services.deltas.progress import WAIT_DEFAULT_S, WAIT_MAX_S
from serve.store.deltas.format import DELTA_MEDIA_TYPE

__all__ = ["router"]

router = APIRouter()

_DISABLED = (f"embedding deltas are off: this sidecar was started without --delta-dir (or "
             f"{DLRM_DELTA_DIR}); restart it with the folder the TorchServe workers follow "
             f"(in Kubernetes a volume shared by both containers)")


_OUTCOME = {"stored": "stored",
            "unchanged": "already stored with the same bytes (kept once)",
            "repaired": "stored in place of the damaged file of that sequence"}


def _service(sidecar: Sidecar) -> DeltaParts:
    if sidecar.deltas is None:
        raise Conflict(f"POST /embeddings/deltas: {_DISABLED}")
    if sidecar.config.deltas_post == "refuse":
        sidecar.deltas.intake.refused.add("volume_only")
        raise _volume_only(sidecar)
    return sidecar.deltas


def _volume_only(sidecar: Sidecar) -> DeltaConflict:
    """The answer of ``--deltas-post refuse``: where to publish the delta instead."""
    config = sidecar.config
    where = [f"{root}/deltas/<version>/{config.model_name}-<version>-NNNNNNNN.delta"
             for root in config.delta_volume_roots]
    return DeltaConflict(
        "deltas_post",
        f"this pod takes no POSTed delta (--deltas-post refuse): it is one pod of a fleet, "
        f"and a delta posted here would live in this pod only. Publish the file `make "
        f"delta` wrote on the delta volume instead, as {' or '.join(where)} (in Kubernetes "
        f"copy it to /deltas/deltas/<version>/ with the delta upload pod, "
        f"k8s/templates/delta-upload-pod.yaml): "
        f"every pod's sidecar takes it from there within {config.delta_sync_s:g} s, in "
        f"sequence order and through the same checks; GET /embeddings/deltas shows each "
        f"pod's last_sequence and head_digest",
        reason="volume_only", details={"publish_to": where})


async def _receive(request: Request, intake: DeltaIntake) -> Accepted:
    """Stream the body into the store (:meth:`DeltaIntake.receive`); never held in memory.
    The edge guard has refused a Content-Length over the delta limit (413) before this
    runs; a declared length that the store's bound cannot hold is refused here (507)
    before a byte is read, and the service checks both bounds again as the body streams."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit():
        try:
            await asyncio.to_thread(intake.check_room, int(length))
        except ServeError as e:
            intake.refused.add(refusal_reason(e))
            raise
    return await intake.receive(request.stream())  # counts its own refusals


@router.post(
    "/embeddings/deltas", response_model=DeltaAnswer, dependencies=[Depends(require_token)],
    summary="Add an embedding delta to a served version and wait until the workers apply it",
    openapi_extra={"requestBody": {"required": True, "content": {
        DELTA_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
    responses={202: {"model": DeltaAnswer,
                     "description": "stored; not every live worker applied it within "
                                    "wait_s (they still will)"},
               400: {"description": "the delta is damaged or does not fit the version's "
                                    "tables (field names the part), or with "
                                    "--delta-verify-key it is unsigned or wrongly signed "
                                    "(field header.signature, reason unsigned or "
                                    "bad_signature)"},
               401: {}, 403: {},
               409: {"description": "its version is not served here, its sequence is not "
                                    "the next one, it builds on another delta than this "
                                    "pod's head (parent_mismatch), deltas are off, or this "
                                    "pod takes deltas from the model volume only "
                                    "(--deltas-post refuse)"},
               413: {"description": "over --max-delta-bytes (DeltaIntake.max_bytes)"}})
async def post_delta(
        request: Request, sidecar: SidecarDep,
        wait_s: Annotated[float, Query(
            ge=0, le=WAIT_MAX_S, description="Seconds to wait for the live workers to "
                                             "apply it (0: do not wait).")] = WAIT_DEFAULT_S,
) -> JSONResponse:
    parts = _service(sidecar)
    accepted = await _receive(request, parts.intake)
    result = await parts.progress.wait_applied(accepted.version, accepted.sequence, wait_s)
    n = len(result.workers)
    stored = _OUTCOME[accepted.outcome]
    if result.applied:
        message = (f"{stored} and applied by all {n} live worker(s) serving "
                   f"{accepted.version}")
    else:
        done = sum(1 for w in result.workers if w.sequence >= accepted.sequence)
        message = (f"{stored}; {done} of {n} live worker(s) serving {accepted.version} "
                   f"applied it within {wait_s:g} s. They apply it between batches, in "
                   f"order: poll GET /embeddings/deltas")
    answer = DeltaAnswer(
        version=accepted.version, sequence=accepted.sequence, rows=accepted.rows,
        bytes=accepted.bytes, applied=result.applied,
        workers=[DeltaWorker(pid=w.pid, sequence=w.sequence, apply_seconds=w.apply_seconds)
                 for w in result.workers],
        waited_s=round(result.waited_s, 3), message=message)
    return JSONResponse(answer.model_dump(mode="json"),
                        status_code=200 if result.applied else 202)


@router.get("/embeddings/deltas", response_model=DeltasStatus,
            summary="Per served version: the embedding deltas stored and what each live "
                    "worker applied")
async def get_deltas(sidecar: SidecarDep) -> DeltasStatus:
    parts = sidecar.deltas
    if parts is None:
        return DeltasStatus(enabled=False, delta_dir=None, versions={}, message=_DISABLED)
    summaries = await parts.report.summaries()
    damaged = await parts.report.damaged()
    return DeltasStatus(
        enabled=True, delta_dir=str(parts.store.root),
        versions={v: EmbeddingsStatus.model_validate(s.to_json())
                  for v, s in summaries.items()},
        damaged=[DamagedDelta(version=v, file=name, reason=why)
                 for v, files in damaged.items() for name, why in files],
        max_bytes=parts.intake.max_bytes, signatures=parts.intake.signatures)
