"""Who may write: the tokens, their scopes, and the one decision
(:func:`authorize`), which the edge guard (:mod:`serve.sidecar.http.edge`) takes before a
byte of the body is read.

Three tokens, each with one scope:

* the operator's (``DLRM_SIDECAR_TOKEN`` or ``--token-file``): every write (PUT /state,
  PUT /batching, PUT /tuner, POST /drain, the rollout's promote and rollback, POST
  /embeddings/deltas, POST /feedback);
* the delta publisher's (``--delta-token-file``): POST /embeddings/deltas only;
* the feedback producer's (``--feedback-token-file``): POST /feedback only.

Answers (the sidecar's JSON shape): 401 without a bearer token (with
``WWW-Authenticate: Bearer``), 403 with a wrong token, with a token of another scope, or
when no token that may do the write is configured (the write is disabled).

:func:`require_token`, the routes' dependency, decides nothing: it shows the bearer
scheme in the OpenAPI document and fails loudly (500) if a write ever reached its route
without the guard having authorized it (an app built without :func:`create_app`'s guard).
"""
from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import Forbidden, Unauthorized
from serve.settings import (
    DLRM_SIDECAR_DELTA_TOKEN_FILE,
    DLRM_SIDECAR_FEEDBACK_TOKEN_FILE,
    DLRM_SIDECAR_TOKEN,
)
from serve.sidecar.config import SidecarConfig

__all__ = ["AUTHORIZED", "DELTAS", "FEEDBACK", "OPERATOR", "SCOPES", "authorize",
           "require_token", "tokens_of"]

#: The scopes, one per token.
OPERATOR = "operator"
DELTAS = "delta publisher"
FEEDBACK = "feedback producer"
SCOPES = (OPERATOR, DELTAS, FEEDBACK)
#: The ASGI scope key where the guard records the scope it authorized a request with.
AUTHORIZED = "dlrm.authorized_scope"

# Where each token comes from, for the messages.
_SOURCE = {OPERATOR: f"the sidecar's --token-file or {DLRM_SIDECAR_TOKEN}",
           DELTAS: f"the sidecar's --delta-token-file or {DLRM_SIDECAR_DELTA_TOKEN_FILE}",
           FEEDBACK: f"the sidecar's --feedback-token-file or "
                     f"{DLRM_SIDECAR_FEEDBACK_TOKEN_FILE}"}


def tokens_of(config: SidecarConfig) -> dict[str, str | None]:
    """Scope -> its configured token (None: not configured)."""
    return {OPERATOR: config.token, DELTAS: config.delta_token,
            FEEDBACK: config.feedback_token}


def _bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for another scheme."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    credentials = credentials.strip()
    return credentials if scheme.lower() == "bearer" and credentials else None


def authorize(what: str, scopes: frozenset[str], authorization: str | None,
              tokens: Mapping[str, str | None]) -> str:
    """The scope of the token in ``authorization`` (the header's value) when it may do
    ``what`` (``"PUT /state"``), which the tokens of ``scopes`` may do.

    Every configured token is compared, each in constant time, whatever the header holds.

    Raises:
        Forbidden: none of ``scopes`` has a token (disabled), the token is none of the
            configured ones, or its scope is not in ``scopes``.
        Unauthorized: no ``Authorization: Bearer <token>`` header.
    """
    allowed = [s for s in SCOPES if s in scopes and tokens.get(s) is not None]
    if not allowed:
        sources = "; ".join(f"the {s}'s: {_SOURCE[s]}" for s in SCOPES if s in scopes)
        raise Forbidden(f"this sidecar has no token configured, so {what} is "
                        f"disabled; start it with a token that may ({sources})")
    presented = _bearer(authorization)
    if presented is None:
        raise Unauthorized(f"{what} needs the header 'Authorization: Bearer <token>'; the "
                           f"token is in {_SOURCE[allowed[0]]}")
    matched = None
    for scope in SCOPES:  # all of them, so the time does not tell which one matched
        token = tokens.get(scope)
        if token is not None and hmac.compare_digest(presented.encode(), token.encode()):
            matched = scope
    if matched is None:
        raise Forbidden(f"the bearer token is wrong; use the one in {_SOURCE[allowed[0]]}")
    if matched not in scopes:
        raise Forbidden(f"the {matched}'s token may not {what}; that needs the "
                        f"{' or the '.join(allowed)}'s token ({_SOURCE[allowed[0]]})")
    return matched


# auto_error=False: the scheme is only documented here; the guard has answered already.
# Module level, because the annotation is resolved from module globals.
_bearer_scheme = HTTPBearer(auto_error=False, description="a token whose scope may do "
                                                         "the write (operator, delta "
                                                         "publisher, feedback producer)")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)]


async def require_token(request: Request, _: _Credentials) -> None:
    """Dependency of every write route: documents the bearer scheme (OpenAPI); the guard
    decided before the body was read. A write that reached its route unauthorized is a
    bug in how the app was built (500), never a silent pass."""
    if request.scope.get(AUTHORIZED) not in SCOPES:
        raise RuntimeError(f"{request.method} {request.url.path} reached its route without "
                           f"the edge guard (serve.sidecar.http.edge); build the app with "
                           f"create_app")
