"""``GET /state`` (desired vs observed, converged or why not) and ``PUT /state`` (declare).

GET is the status of the serving state: the desired state (the file), what TorchServe
serves (read now), ``converged``, the ``reason`` when not, the switch's ``phase``, the
``last_error``, the ``last_switch`` (duration, peak memory) and the repository's versions.

PUT takes a whole desired state (the ``desired`` object of GET), validates it (400 naming
the field and the rule; a version the repository lacks names the ones it has), writes the
file atomically and answers 202 at once: the reconciler applies it; poll GET /state.
Where the file is read-only (a ConfigMap) it answers 409 and says to edit the ConfigMap.
A rollout whose candidate has another request schema than ``model.version`` (dense count,
sparse features, their order, max ids; :meth:`serve.schema.ModelSchema.request_differences`)
is refused with 409 naming the differences; other table sizes and dims are fine. So is a
switch of ``model.version`` to another request schema than the declared one, unless the
declaration sets ``model.schema_change: true``
(:func:`serve.sidecar.adapters.model_schemas.check_switch_schema`).

GET's ``observed.model.schema`` is the served version's request schema
(:meth:`serve.schema.ModelSchema.describe`), read once per version from its build report;
null when the version has no report or no derivable schema.

GET's ``observed.tables`` are the table tiers' hit rates (device cache, host-memory tier
over the table files), read from the workers' metrics over the sidecar's recent window
(:mod:`serve.sidecar.services.tiers`); null without the workers' metrics directory or
before any worker reports a tier.

GET's ``endpoints.oip_url`` is the Open Inference Protocol's base URL (``--oip-port``,
:mod:`serve.sidecar.http.routes_oip`) on the host the GET reached; null when not served.

``POST /state/rollout/promote`` and ``POST /state/rollout/rollback`` end a baking rollout
by hand, one call each (409 when none is baking); GET /state's ``rollout`` shows it.

With ``--delta-dir``, GET /state also has ``embeddings``: per served version, the last
embedding delta stored and what the live workers applied (:mod:`serve.sidecar.services.deltas`).
Its ``id_maps`` describe each managed feature's id map (:mod:`serve.runtime.idmap`):
capacity, ids, occupancy, ids admitted and evicted by the applied deltas, fallback
lookups; ``[]`` for a version whose tables are all modulo.
"""
from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from pydantic import ValidationError

from serve.errors import ConfigError, InvalidInput, UpstreamUnavailable
from serve.sidecar.adapters.model_schemas import check_rollout_schema
from serve.sidecar.adapters.torchserve import Observed, observe
from serve.sidecar.control.assessment import observed_state
from serve.sidecar.http.auth import require_token
from serve.sidecar.http.routes_tuner import tuner_status
from serve.sidecar.http.schemas import (
    DeltaTrust,
    EmbeddingsStatus,
    ObservedState,
    RolloutStatus,
    ServiceEndpoints,
    SidecarEndpoints,
    StateAccepted,
    StateStatus,
)
from serve.sidecar.root import Sidecar, SidecarDep
from serve.state import DesiredState, describe_validation_error

__all__ = ["router"]

router = APIRouter()

_SHAPE = ('a desired state is {"model": {"version": V}, "batching": {"batch_size": 1..4096, '
          '"max_batch_delay_ms": 0..10000}, "workers": 1..64, "rollout": null or '
          '{"candidate": V2, "mode": "canary"|"shadow", "weight": 0..1, "steps": [...], '
          '"bake_s": s, "guards": {...}}}')


@router.get("/state", response_model=StateStatus, response_model_by_alias=True,
            summary="Desired vs observed serving state, converged or why not")
async def get_state(request: Request, sidecar: SidecarDep) -> StateStatus:
    reconciler = sidecar.reconciler
    if reconciler is not None:
        status = await reconciler.status()
    else:
        status = await _status_without_file(sidecar)
    status = status.model_copy(update={
        "tuner": tuner_status(sidecar),
        "sidecar": SidecarEndpoints(write_port=sidecar.write_port),
        "endpoints": ServiceEndpoints(oip_url=_oip_url(request, sidecar))})
    if sidecar.tiers is not None:
        tables = await asyncio.to_thread(sidecar.tiers.view)
        status = status.model_copy(update={
            "observed": status.observed.model_copy(update={"tables": tables})})
    if sidecar.deltas is not None:
        summaries = await sidecar.deltas.report.summaries()
        status = status.model_copy(update={"embeddings": {
            v: EmbeddingsStatus.model_validate(s.to_json()) for v, s in summaries.items()},
            "deltas": DeltaTrust(signatures=sidecar.deltas.intake.signatures)})
    return status


@router.put("/state", status_code=202, response_model=StateAccepted,
            dependencies=[Depends(require_token)],
            summary="Declare the desired serving state (applied in the background)",
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/DesiredState"}}}}},
            responses={400: {"description": "invalid desired state"}, 401: {}, 403: {},
                       409: {"description": "the desired-state file is read-only (a "
                                            "ConfigMap), or the sidecar has none; or the "
                                            "rollout's candidate takes other requests "
                                            "(another request schema) than model.version; "
                                            "or model.version switches to another request "
                                            "schema without model.schema_change"}})
async def put_state(body: Annotated[Any, Body()], sidecar: SidecarDep) -> StateAccepted:
    reconciler = sidecar.require_reconciler("PUT /state")
    desired = _validated(body, sidecar)
    reconciler.check_schema(desired)  # 409 before anything changes (the tuner's pin too)
    declared = reconciler.desired
    if declared is not None and desired.batching != declared.batching \
            and sidecar.tuning is not None:
        sidecar.tuning.pin_batching(f"PUT /state declaring batching "
                                    f"{desired.batching.batch_size}/"
                                    f"{desired.batching.max_batch_delay_ms} ms")
    last = reconciler.last_pass
    converged = bool(last is not None and last.converged and reconciler.desired == desired)
    reconciler.write(desired)
    return StateAccepted(
        desired=desired, converged=converged, target_serving_version=desired.serving_version(),
        state_file=str(reconciler.path),
        message="written; the reconciler applies it now: GET /state shows the progress")


def _oip_url(request: Request, sidecar: Sidecar) -> str | None:
    """The Open Inference Protocol's base URL on the host this request reached: the OIP
    port listens on the same address (one process, one ``--host``)."""
    if not sidecar.oip_port:
        return None
    host = request.url.hostname or "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{sidecar.oip_port}"


def _validated(body: Any, sidecar: Sidecar) -> DesiredState:
    """The body as a desired state whose versions are in the repository with their
    tables (else 400), and whose rollout's candidate takes the stable version's requests
    (else 409)."""
    if not isinstance(body, dict):
        raise InvalidInput(f"invalid PUT /state body: body: must be a JSON object "
                           f"(got {type(body).__name__}); {_SHAPE}")
    try:
        desired = DesiredState.model_validate(body)
    except ValidationError as e:
        raise InvalidInput(f"invalid PUT /state body: {describe_validation_error(e)}"
                           ) from None
    repository = sidecar.repository
    versions = [("model.version", desired.model.version)]
    if desired.rollout is not None:
        versions.append(("rollout.candidate", desired.rollout.candidate))
    for where, version in versions:
        if repository is None:
            continue
        try:  # in the repository, with the tables folder its archive references
            repository.check_tables(version)
        except ConfigError as e:
            raise InvalidInput(f"invalid PUT /state body: {where}: {e.message}") from None
    if desired.rollout is not None and sidecar.schemas is not None:
        # Both exist; the candidate must take the stable version's requests (409).
        check_rollout_schema(sidecar.schemas, desired.model.version, desired.rollout.candidate)
    return desired


@router.post("/state/rollout/promote", response_model=RolloutStatus,
             dependencies=[Depends(require_token)],
             summary="Promote the baking rollout's candidate now",
             responses={401: {}, 403: {}, 409: {"description": "no rollout is baking"}})
async def promote(sidecar: SidecarDep) -> RolloutStatus:
    reconciler = sidecar.require_reconciler("POST /state/rollout/promote")
    return reconciler.end_rollout(True, "promoted by hand (POST /state/rollout/promote)")


@router.post("/state/rollout/rollback", response_model=RolloutStatus,
             dependencies=[Depends(require_token)],
             summary="Roll the baking rollout's candidate back now",
             responses={401: {}, 403: {}, 409: {"description": "no rollout is baking"}})
async def rollback(sidecar: SidecarDep) -> RolloutStatus:
    reconciler = sidecar.require_reconciler("POST /state/rollout/rollback")
    return reconciler.end_rollout(False, "rolled back by hand (POST /state/rollout/rollback)")


async def _status_without_file(sidecar: Sidecar) -> StateStatus:
    """GET /state of a sidecar started without --state-file: what serves, and why
    nothing is reconciled."""
    reason = ("this sidecar was started without --state-file: nothing declares what to "
              "serve, and nothing is reconciled")
    try:
        schema_of = sidecar.schemas.describe if sidecar.schemas is not None else None
        observed: ObservedState = observed_state(await observe(sidecar.torchserve), schema_of)
    except UpstreamUnavailable as e:
        observed = observed_state(Observed(default=None))
        reason = f"{reason}; TorchServe did not answer: {e.message}"
    versions = sidecar.repository.versions() if sidecar.repository is not None else []
    return StateStatus(desired=None, observed=observed, converged=False, reason=reason,
                       phase=sidecar.switch.phase.value, last_error=sidecar.switch.last_error,
                       last_switch=None, target_serving_version=None,
                       available_versions=versions, state_file=None,
                       state_file_writable=False)
