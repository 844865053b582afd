"""The sidecar's ``/docs`` works without the internet (air-gapped clusters).

Unit: the page references only the sidecar's own URLs, and those assets are served.
Integration: the real sidecar under uvicorn, rendered by headless Debian chromium; the
dumped DOM holds Swagger UI's rendered operations (so its JavaScript ran, from the local
assets), and a screenshot is written under the test's ``tmp_path``.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serve.sidecar.config import SidecarConfig
from serve.sidecar.http.app import create_app
from tests.fixtures.sidecar import dead_port, start_sidecar
from tests.fixtures.tools import require_tool

TITLE = "DLRM serving sidecar"
#: ``src``/``href`` attribute values in the page's tags.
_URL_ATTR = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
#: Swagger UI's init script names its asset-like URLs too (``url: '/openapi.json'``).
_QUOTED_URL = re.compile(r"""["'](/[^"'\s]*|https?://[^"'\s]*|//[^"'\s]*)["']""")
_EXTERNAL = re.compile(r"https?://|//cdn", re.IGNORECASE)
CHROMIUM_TIMEOUT_S = 60


def _app(tmp_path: Path):
    port = dead_port()  # no TorchServe: /docs must not depend on it
    dead = f"http://127.0.0.1:{port}"
    return create_app(SidecarConfig(management_url=dead, metrics_url=dead, inference_url=dead,
                                    token="t0ken-for-tests-t0ken-for-tests-0123", multiproc_dir=tmp_path))


def test_docs_page_and_assets_are_served_locally(tmp_path: Path) -> None:
    with TestClient(_app(tmp_path)) as c:
        page = c.get("/docs")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        html = page.text
        tags = re.findall(r"<(?:script|link)\b[^>]*>", html, re.IGNORECASE)
        assert tags, html
        for tag in tags:
            assert not _EXTERNAL.search(tag), f"external URL in {tag}"
        urls = _URL_ATTR.findall(html) + _QUOTED_URL.findall(html)
        external = [u for u in urls if _EXTERNAL.search(u)]
        assert not external, f"/docs points outside the sidecar: {external}"
        assets = {u for u in _URL_ATTR.findall(html) if u.startswith("/")}
        assert assets == {"/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"}, assets
        assert "'/openapi.json'" in html or '"/openapi.json"' in html

        js = c.get("/docs/swagger-ui-bundle.js")
        assert js.status_code == 200
        assert js.headers["content-type"].startswith("text/javascript")
        assert len(js.content) > 500_000
        assert b"SwaggerUIBundle" in js.content
        assert "max-age" in js.headers["cache-control"]
        css = c.get("/docs/swagger-ui.css")
        assert css.status_code == 200
        assert css.headers["content-type"].startswith("text/css")
        assert len(css.content) > 50_000 and b".swagger-ui" in css.content
        assert "max-age" in css.headers["cache-control"]
        oauth2 = c.get("/docs/oauth2-redirect")
        assert oauth2.status_code == 200 and "text/html" in oauth2.headers["content-type"]

        spec = c.get("/openapi.json")
        assert spec.status_code == 200
        assert spec.json()["info"]["title"] == TITLE
        assert spec.json()["openapi"].startswith("3.1")
        assert not [p for p in spec.json()["paths"] if p.startswith("/docs")]
        assert c.get("/redoc").status_code == 404

        # The docs routes count under their own templates: metric labels stay bounded.
        metrics = c.get("/metrics").text
        assert re.search(r'dlrm_sidecar_requests_total\{[^}]*route="/docs/swagger-ui-bundle.js"',
                         metrics), metrics[-3000:]
        assert 'route="/redoc"' not in metrics


# ------------------------------------------------------------------ headless browser


def _chromium() -> str:
    return require_tool("chromium", "it renders the sidecar's /docs headless",
                        "bash scripts/ensure_chromium.sh")


def _run_chromium(exe: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions",
           f"--user-data-dir={profile}", "--virtual-time-budget=10000",
           # Air-gapped: every host name but the sidecar's loopback fails to resolve.
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=CHROMIUM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"chromium did not finish in {CHROMIUM_TIMEOUT_S} s: {' '.join(cmd)}\n"
                    f"{(e.stderr or b'')[-2000:]!r}")


@pytest.mark.needs_chromium
@pytest.mark.integration
def test_real_sidecar_docs_render_in_headless_chromium(tmp_path: Path) -> None:
    exe = _chromium()
    dead = f"http://127.0.0.1:{dead_port()}"  # no TorchServe, no state file: no reconciler
    sc = start_sidecar(tmp_path / "sidecar", management_url=dead, metrics_url=dead,
                       inference_url=dead, model_name="dlrm", multiproc_dir=tmp_path / "prom",
                       model_store=tmp_path / "store")
    try:
        url = f"{sc.url}/docs"
        dom = _run_chromium(exe, tmp_path / "profile-dom", "--dump-dom", url)
        out = dom.stdout
        assert dom.returncode == 0 and out, f"chromium failed ({dom.returncode}):\n" \
                                            f"{dom.stderr[-3000:]}"
        # All of this is rendered by Swagger UI's JS (the served page has only an empty
        # <div id="swagger-ui">): it ran, from the local assets, and read /openapi.json.
        assert 'class="swagger-ui"' in out, out[:3000]
        assert re.search(rf'<h1 class="title">{re.escape(TITLE)}\b', out), out[:3000]
        assert "OAS 3.1" in out
        opblocks = out.split('<div class="opblock opblock-')[1:]
        paths = {m.group(1) for b in opblocks if (m := re.search(r'data-path="([^"]+)"', b))}
        assert {"/state", "/metrics", "/healthz"} <= paths, (paths, out[:5000])
        assert "Failed to load API definition" not in out

        png = tmp_path / "docs.png"
        shot = _run_chromium(exe, tmp_path / "profile-shot", f"--screenshot={png}",
                             "--window-size=1280,2000", url)
        assert shot.returncode == 0, shot.stderr[-3000:]
        assert png.is_file(), shot.stderr[-3000:]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 10_000, png.stat().st_size
    finally:
        sc.stop()
    log = sc.log.read_text()
    assert "Traceback" not in log, log[-3000:]
