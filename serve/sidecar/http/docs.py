"""``/docs``: Swagger UI served from the sidecar itself, never from a CDN.

FastAPI's default ``/docs`` page loads Swagger UI's JavaScript and CSS from a public CDN
(jsdelivr). The sidecar runs in clusters without internet access (air-gapped), where that
page renders blank. :func:`mount_docs` serves the same page with the assets of the pinned
``fastapi-swagger`` package (Swagger UI 5, which OpenAPI 3.1 from FastAPI needs), read
once at mount time from the installed package files: nothing on the page points at any
other host. Only its two asset files are used; its ``patch_fastapi`` is not.

Routes (all ``GET``, left out of the OpenAPI schema, no token: read-only documentation):

* ``{prefix}``: the Swagger UI page for the app's ``openapi_url``;
* ``{prefix}/swagger-ui-bundle.js`` and ``{prefix}/swagger-ui.css``: the assets;
* ``{prefix}/oauth2-redirect``: Swagger UI's OAuth2 redirect page.

ReDoc is not offered (its page would need a CDN too): create the app with
``redoc_url=None`` and ``docs_url=None`` and call :func:`mount_docs` instead.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.responses import HTMLResponse, Response

__all__ = ["ASSET_PACKAGE", "mount_docs"]

#: The package whose ``resources/`` folder holds Swagger UI's built assets.
ASSET_PACKAGE = "fastapi_swagger"
_JS = "swagger-ui-bundle.js"
_CSS = "swagger-ui.css"
#: The assets change only with the installed package, i.e. with a new image.
_CACHE_CONTROL = "public, max-age=86400"
#: No favicon request at all (an empty icon), rather than one more route.
_NO_FAVICON = "data:,"


def _asset(name: str) -> bytes:
    try:
        return (resources.files(ASSET_PACKAGE) / "resources" / name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError(
            f"Swagger UI asset {ASSET_PACKAGE}/resources/{name} is missing ({e}); install "
            f"the pinned {ASSET_PACKAGE.replace('_', '-')} from requirements.txt") from None


def mount_docs(app: FastAPI, *, prefix: str = "/docs") -> None:
    """Serve Swagger UI for ``app`` at ``prefix`` with local assets only (see module doc).

    Raises:
        RuntimeError: the asset package is not installed (at mount time, not per request).
    """
    prefix = "/" + prefix.strip("/")
    js, css = _asset(_JS), _asset(_CSS)
    oauth2_url = f"{prefix}/oauth2-redirect"
    cache = {"Cache-Control": _CACHE_CONTROL}

    @app.get(prefix, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        # Under the app's root_path (behind a path-prefixing proxy), as FastAPI's own /docs.
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{prefix}/{_JS}", swagger_css_url=f"{root}{prefix}/{_CSS}",
            swagger_favicon_url=_NO_FAVICON, oauth2_redirect_url=root + oauth2_url)

    @app.get(f"{prefix}/{_JS}", include_in_schema=False)
    async def swagger_js() -> Response:
        return Response(js, media_type="text/javascript; charset=utf-8", headers=cache)

    @app.get(f"{prefix}/{_CSS}", include_in_schema=False)
    async def swagger_css() -> Response:
        return Response(css, media_type="text/css; charset=utf-8", headers=cache)

    @app.get(oauth2_url, include_in_schema=False)
    async def swagger_oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
