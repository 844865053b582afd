"""``POST /feedback`` (bearer token): click labels for earlier predictions; ``GET
/feedback``: the join's state, the online CTR/calibration/AUC per version and arm beside
each version's build-time baseline.

Labels are joined with the pod's prediction log (:mod:`serve.sidecar.services.feedback`). A label
for an id this pod never logged, or whose log was rotated away, is counted, not refused
(feedback comes late, and from outside); a body that breaks the schema is a 400 naming
the field and the rule.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from serve.sidecar.http.auth import require_token
from serve.sidecar.http.schemas import FeedbackAnswer, FeedbackBody
from serve.sidecar.root import SidecarDep

__all__ = ["router"]

router = APIRouter()


@router.post("/feedback", response_model=FeedbackAnswer, dependencies=[Depends(require_token)],
             summary="Click labels for earlier predictions (joined with the prediction log)",
             responses={400: {"description": "a label breaks the schema"}, 401: {}, 403: {}})
async def post_feedback(body: FeedbackBody, sidecar: SidecarDep) -> FeedbackAnswer:
    triples = [(x.request_id, x.index, x.label) for x in body.labels]
    result = await asyncio.to_thread(sidecar.feedback.post, triples)
    return FeedbackAnswer(**result.to_json())


@router.get("/feedback", summary="Online CTR, calibration and AUC per version and arm, with "
                                 "each version's build-time baseline")
async def get_feedback(sidecar: SidecarDep) -> dict:
    return await asyncio.to_thread(sidecar.feedback.status)
