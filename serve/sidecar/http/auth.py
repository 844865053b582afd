"""The write token: the bearer token every write (PUT /state, PUT /batching, PUT /tuner,
POST /feedback, POST /embeddings/deltas, POST /drain) needs.

Missing or wrong headers are answered with the sidecar's JSON shape: 401 without a
token (with ``WWW-Authenticate: Bearer``), 403 with a wrong one or when writes are
disabled (no token configured).
"""
from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serve.errors import Forbidden, Unauthorized
from serve.settings import DLRM_SIDECAR_TOKEN
from serve.sidecar.root import SidecarDep

__all__ = ["require_token"]

# auto_error=False: missing/wrong headers are answered by require_token with our JSON
# shape (401 vs 403), not by FastAPI's default. Module level, because the annotation
# is resolved from module globals (``from __future__ import annotations``).
_bearer = HTTPBearer(auto_error=False, description="the write token: every write needs it")
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_token(request: Request, credentials: _Credentials, state: SidecarDep) -> None:
    """Dependency: 403 when writes are disabled or the token is wrong, 401 without one."""
    what = f"{request.method} {request.url.path}"
    token = state.config.token
    if token is None:
        raise Forbidden(f"this sidecar has no token configured, so {what} is "
                        f"disabled; start it with --token-file or {DLRM_SIDECAR_TOKEN}")
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized(f"{what} needs the header 'Authorization: Bearer <token>'; the "
                           f"token is in the sidecar's --token-file or {DLRM_SIDECAR_TOKEN}")
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise Forbidden("the bearer token is wrong; use the one in the sidecar's "
                        f"--token-file or {DLRM_SIDECAR_TOKEN}")
