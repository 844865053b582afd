"""The layer rules: what runs in the pod never imports the offline build or TorchRec, and
nothing in ``serve/`` imports ``handlers/`` (the TorchServe adapter sits on top).

Checked twice: statically (every import statement in the pod's packages, including the
lazy ones inside functions) and dynamically (importing the pod's modules in a fresh
interpreter loads neither ``serve.model`` nor ``torchrec`` nor ``fbgemm_gpu``).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
POD_PACKAGES = ("serve/runtime", "serve/api", "serve/worker", "serve/sidecar", "handlers")
FORBIDDEN = ("serve.model", "torchrec", "fbgemm_gpu")
# Shared ground at the top of serve/ is imported by every layer, so it obeys the rule too.
SHARED = ("serve/errors.py", "serve/profiles.py", "serve/metrics", "serve/constants.py",
          "serve/schema.py", "serve/state.py", "serve/settings.py", "serve/phases.py",
          "serve/rowformat.py", "serve/store", "serve/common")
# The sidecar's own layers, edge first: each may import only the layers after it.
SIDECAR_LAYERS = ("http", "root", "services", "control", "adapters")
# Only these modules may sit at the top of serve/ (the vocabulary every layer shares);
# everything else belongs to a layer's package.
TOP_OF_SERVE = {"__init__.py", "errors.py", "constants.py", "state.py", "schema.py",
                "profiles.py", "metrics.py", "settings.py", "phases.py", "rowformat.py"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names]
    return found


def _pod_files() -> list[Path]:
    files = [p for d in POD_PACKAGES for p in sorted((REPO / d).rglob("*.py"))]
    for f in SHARED:
        path = REPO / f
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return files


def test_pod_packages_exist() -> None:
    for d in POD_PACKAGES:
        assert list((REPO / d).glob("*.py")), f"{d} has no modules: the layer check would pass vacuously"


@pytest.mark.parametrize("path", _pod_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_pod_code_never_imports_the_build_or_torchrec(path: Path) -> None:
    bad = [f"{path.relative_to(REPO)}:{line} imports {mod}" for line, mod in _imports(path)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sorted((REPO / "serve").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_nothing_in_serve_imports_the_torchserve_adapter(path: Path) -> None:
    """handlers/ translates TorchServe's calls into one call to serve.worker; nothing
    calls back up into it."""
    bad = [f"{path.relative_to(REPO)}:{line} imports {mod}" for line, mod in _imports(path)
           if mod == "handlers" or mod.startswith("handlers.")]
    assert not bad, "\n".join(bad)


def test_import_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function, and a relative one, are found."""
    pkg = REPO / "serve" / "runtime"
    probe = pkg / "_layer_probe_tmp.py"
    probe.write_text("def f():\n    import torchrec\n    from ..model import dlrm\n")
    try:
        mods = [m for _, m in _imports(probe)]
    finally:
        probe.unlink()
    assert mods == ["torchrec", "serve.model.dlrm"]


def test_importing_the_pod_modules_loads_no_build_code() -> None:
    code = (
        "import sys\n"
        "import serve.runtime.engine, serve.runtime.cache, serve.api.protocol, serve.worker\n"
        "import serve.sidecar.http.app, serve.metrics, serve.store.routing, serve.common.cpu\n"
        f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
        f"for f in {FORBIDDEN!r}))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pod modules loaded {proc.stdout.strip()}\n{proc.stderr[-2000:]}"


def _sidecar_layer(module: str) -> str | None:
    """The sidecar layer a dotted module belongs to (``root`` for serve.sidecar.root);
    None for anything else (config and the package itself are shared by every layer)."""
    parts = module.split(".")
    if parts[:2] != ["serve", "sidecar"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SIDECAR_LAYERS else None


def _sidecar_files() -> list[Path]:
    return sorted((REPO / "serve" / "sidecar").rglob("*.py"))


def test_the_sidecar_has_its_layers() -> None:
    names = {p.name for p in (REPO / "serve" / "sidecar").iterdir()}
    assert {"http", "control", "adapters", "services"} <= names, sorted(names)
    flat = sorted(n for n in names if n.endswith(".py")
                  and n not in {"__init__.py", "__main__.py", "config.py", "root.py"})
    assert not flat, f"modules outside the sidecar's layers: {flat}"


@pytest.mark.parametrize("path", _sidecar_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_sidecar_imports_only_point_inwards(path: Path) -> None:
    """http -> root -> services -> control -> adapters: a layer imports only the layers
    after it (and the sidecar's config), never one before it."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    own = _sidecar_layer(module)
    if own is None:
        return
    allowed = SIDECAR_LAYERS[SIDECAR_LAYERS.index(own):]
    bad = [f"{path.relative_to(REPO)}:{line} ({own}) imports {mod}"
           for line, mod in _imports(path)
           if (layer := _sidecar_layer(mod)) is not None and layer not in allowed]
    assert not bad, "\n".join(bad)


def test_sidecar_layer_check_catches_an_import_back(tmp_path: Path) -> None:
    """The checker itself: an adapter importing the HTTP edge is a violation."""
    probe = REPO / "serve" / "sidecar" / "adapters" / "_layer_probe_tmp.py"
    probe.write_text("def f():\n    from serve.sidecar.http import app\n")
    try:
        with pytest.raises(AssertionError, match="imports serve.sidecar.http.app"):
            test_sidecar_imports_only_point_inwards(probe)
    finally:
        probe.unlink()


def test_only_the_shared_vocabulary_sits_at_the_top_of_serve() -> None:
    flat = sorted(p.name for p in (REPO / "serve").glob("*.py") if p.name not in TOP_OF_SERVE)
    assert not flat, f"modules at the top of serve/ that belong to a layer: {flat}"
