"""The layer rules of ``serve/``: every import points down, and no import runs in a circle.

* **Floors** (:data:`FLOORS`, lowest first): a module imports only rooms on lower floors and
  its own room (package), never a room beside it on the same floor. The ground floor has
  an order of its own (:data:`GROUND`), so a circle there is caught too.
* **The sidecar's layers** (:data:`SIDECAR_LAYERS`, edge first): each imports only the
  layers after it; ``config`` is the lowest and imports none of them. No exemption.
* **No circle** among ``serve/`` modules (the module graph, lazy imports included).
* What runs in the pod never imports the offline build or TorchRec, checked statically and
  in a fresh interpreter; nothing in ``serve/`` imports ``handlers/`` (the TorchServe
  adapter sits on top).

Every import statement counts: module level, inside functions (lazy), under
``TYPE_CHECKING``, relative ones resolved. The checkers take a file and the module name it
stands for, so their self-tests plant probes in ``tmp_path``, never in the package.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: The ground floor's rooms in their own order, lowest first: each imports only rooms
#: before it (``serve`` is the package itself, which imports nothing).
GROUND: tuple[str, ...] = (
    "serve", "serve.errors", "serve.constants", "serve.settings", "serve.phases",
    "serve.metrics", "serve.common", "serve.rowformat", "serve.schema", "serve.state",
    "serve.profiles",
)
#: The floors of serve/, lowest first. A room (package or module) imports lower floors
#: and itself only; rooms on one floor never import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    GROUND,
    ("serve.store",),
    ("serve.runtime", "serve.api"),
    ("serve.worker", "serve.sidecar", "serve.model"),
    ("serve.ops",),
)
POD_PACKAGES = ("serve/runtime", "serve/api", "serve/worker", "serve/sidecar", "handlers")
FORBIDDEN = ("serve.model", "torchrec", "fbgemm_gpu")
# The sidecar's own layers, edge first: each may import only the layers after it.
SIDECAR_LAYERS = ("__main__", "http", "root", "services", "control", "adapters", "config")
# Only these modules may sit at the top of serve/ (the vocabulary every layer shares);
# everything else belongs to a layer's package.
TOP_OF_SERVE = {"__init__.py", "errors.py", "constants.py", "state.py", "schema.py",
                "profiles.py", "settings.py", "phases.py", "rowformat.py"}


# --------------------------------------------------------------------------- the reader

def module_name(path: Path, root: Path = REPO) -> str:
    """The dotted module a file under ``root`` is (``serve/store/__init__.py`` ->
    ``serve.store``)."""
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) for every import in ``path``, read as module ``module``:
    ``import a.b`` gives ``a.b``, ``from a import b`` gives ``a.b``, relative imports are
    resolved against ``module``'s package. Lazy and ``TYPE_CHECKING`` imports included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
    return sorted(found, key=lambda item: item[0])


def serve_modules(root: Path = REPO) -> dict[str, Path]:
    """Every module of ``root/serve`` by dotted name."""
    return {module_name(p, root): p for p in sorted((root / "serve").rglob("*.py"))}


@functools.cache
def _serve() -> dict[str, Path]:
    """This checkout's modules (read once per test session)."""
    return serve_modules()


def resolve(name: str, known: Iterable[str]) -> str | None:
    """The module of ``known`` that ``name`` is or lies in (``serve.metrics.ARMS`` ->
    ``serve.metrics``); None outside them (the standard library, torch...)."""
    known = set(known)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


# --------------------------------------------------------------------------- floors

def room_of(module: str) -> str | None:
    """The declared room a serve module lives in: the longest room that is the module or
    a package above it (``serve`` itself only as the package module)."""
    rooms = [r for floor in FLOORS for r in floor]
    if module == "serve":
        return "serve"
    matches = [r for r in rooms if r != "serve" and (module == r or module.startswith(r + "."))]
    return max(matches, key=len) if matches else None


def _floor(room: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if room in floor)


def may_import(src_room: str, dst_room: str) -> bool:
    """Whether room ``src_room`` may import room ``dst_room``: its own room, a lower
    floor, or on the ground floor an earlier room of :data:`GROUND`."""
    if src_room == dst_room:
        return True
    src, dst = _floor(src_room), _floor(dst_room)
    if src == dst == 0:
        return GROUND.index(dst_room) < GROUND.index(src_room)
    return dst < src


def floor_violations(path: Path, module: str, known: Iterable[str]) -> list[str]:
    """The imports of ``path`` (read as ``module``) that point up or sideways."""
    known = set(known) | {module}
    src = room_of(module)
    if src is None:
        return [f"{module} is in no room of FLOORS: declare where it lives"]
    bad: list[str] = []
    for line, name in imports_of(path, module):
        target = resolve(name, known)
        if target is None or target == module:
            continue
        dst = room_of(target)
        found = f"{module}:{line} ({src}) imports {target} ({dst})"
        if (dst is None or not may_import(src, dst)) and found not in bad:
            bad.append(found)
    return bad


# --------------------------------------------------------------------------- circles

def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules among ``modules`` it imports (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name, modules) for _, name in imports_of(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def import_circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each sorted; empty when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


# --------------------------------------------------------------------------- the sidecar

def _sidecar_layer(module: str) -> str | None:
    """The sidecar layer a dotted module belongs to (``root`` for serve.sidecar.root);
    None outside the sidecar and for the package itself (which imports nothing)."""
    parts = module.split(".")
    if parts[:2] != ["serve", "sidecar"] or len(parts) < 3:
        return None
    return parts[2]


def sidecar_violations(path: Path, module: str) -> list[str]:
    """The imports of ``path`` (read as sidecar module ``module``) that point outwards."""
    own = _sidecar_layer(module)
    if own is None:
        return []
    if own not in SIDECAR_LAYERS:
        return [f"{module} is in no sidecar layer of {SIDECAR_LAYERS}"]
    allowed = SIDECAR_LAYERS[SIDECAR_LAYERS.index(own):]
    return [f"{module}:{line} ({own}) imports {mod}"
            for line, mod in imports_of(path, module)
            if (layer := _sidecar_layer(mod)) is not None and layer not in allowed]


# --------------------------------------------------------------------------- tests

def _ids(p: Path) -> str:
    return str(p.relative_to(REPO))


def _pod_files() -> list[Path]:
    files = [p for d in POD_PACKAGES for p in sorted((REPO / d).rglob("*.py"))]
    shared = {"serve.store", *GROUND}
    return files + [p for m, p in serve_modules().items() if room_of(m) in shared]


def test_pod_packages_exist() -> None:
    for d in POD_PACKAGES:
        assert list((REPO / d).glob("*.py")), f"{d} has no modules: the layer check would pass vacuously"


@pytest.mark.parametrize("path", _pod_files(), ids=_ids)
def test_pod_code_never_imports_the_build_or_torchrec(path: Path) -> None:
    module = module_name(path)
    bad = [f"{_ids(path)}:{line} imports {mod}" for line, mod in imports_of(path, module)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", sorted((REPO / "serve").rglob("*.py")), ids=_ids)
def test_nothing_in_serve_imports_the_torchserve_adapter(path: Path) -> None:
    """handlers/ translates TorchServe's calls into one call to serve.worker; nothing
    calls back up into it."""
    bad = [f"{_ids(path)}:{line} imports {mod}" for line, mod in imports_of(path, module_name(path))
           if mod == "handlers" or mod.startswith("handlers.")]
    assert not bad, "\n".join(bad)


def test_every_serve_module_has_a_room() -> None:
    homeless = sorted(m for m in serve_modules() if room_of(m) is None)
    assert not homeless, f"modules in no room of FLOORS: {homeless}"


@pytest.mark.parametrize("path", sorted((REPO / "serve").rglob("*.py")), ids=_ids)
def test_every_import_in_serve_points_down(path: Path) -> None:
    bad = floor_violations(path, module_name(path), _serve())
    assert not bad, "\n".join(bad)


def test_no_import_circle_in_serve() -> None:
    circles = import_circles(import_graph(_serve()))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_planted_circle(tmp_path: Path) -> None:
    """The finder itself, on a graph and on files: a -> b -> c -> a is one circle, a
    module importing the circle from outside is not part of it."""
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    pkg = tmp_path / "serve"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "left.py").write_text("def f():\n    from serve.right import g\n")
    (pkg / "right.py").write_text("from . import left\n")
    (pkg / "leaf.py").write_text("import serve.left\n")
    graph = import_graph(serve_modules(tmp_path))
    assert graph["serve.leaf"] == {"serve.left"}
    assert import_circles(graph) == [["serve.left", "serve.right"]]


def test_import_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function, a relative one and one under
    TYPE_CHECKING are found, and a runtime module importing the build is a violation."""
    probe = tmp_path / "_layer_probe.py"
    probe.write_text("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from serve.ops import launcher\n"
                     "def f():\n    import torchrec\n    from ..model import dlrm\n")
    mods = [m for _, m in imports_of(probe, "serve.runtime._layer_probe")]
    assert mods == ["typing.TYPE_CHECKING", "serve.ops.launcher", "torchrec", "serve.model.dlrm"]
    bad = floor_violations(probe, "serve.runtime._layer_probe", _serve())
    assert [b.split(" imports ")[1] for b in bad] == ["serve.ops.launcher (serve.ops)",
                                                      "serve.model.dlrm (serve.model)"]


@pytest.mark.parametrize(("module", "source", "verdict"), [
    ("serve.store._probe", "def f():\n    from serve.sidecar import root\n",
     "imports serve.sidecar.root (serve.sidecar)"),
    ("serve.runtime._probe", "from serve.api import decode\n",
     "imports serve.api.decode (serve.api)"),
    ("serve.schema", "from serve.profiles import get_profile\n",
     "imports serve.profiles (serve.profiles)"),
    ("serve.metrics._probe", "from serve import settings\nfrom serve.schema import ModelSchema\n",
     "imports serve.schema (serve.schema)"),
    ("serve.model._probe", "from serve.store import routing\nfrom serve.ops.heldout import score_split\n",
     "imports serve.ops.heldout (serve.ops)"),
])
def test_floor_check_catches_an_import_up_or_sideways(tmp_path: Path, module: str, source: str,
                                                       verdict: str) -> None:
    """The checker itself: a lower floor importing a higher one, a room importing one
    beside it, and a ground module importing a later one are violations; the downward
    imports in the same probe are not."""
    probe = tmp_path / "_probe.py"
    probe.write_text(source)
    bad = floor_violations(probe, module, _serve())
    assert len(bad) == 1 and bad[0].endswith(verdict), bad


def test_floor_check_passes_downward_imports(tmp_path: Path) -> None:
    probe = tmp_path / "_probe.py"
    probe.write_text("from serve.store.routing import RoutingFile\nfrom serve.metrics import ARMS\n"
                     "def f():\n    from serve.runtime import engine\n    from . import batch\n")
    assert floor_violations(probe, "serve.worker._probe", _serve()) == []


def test_importing_the_pod_modules_loads_no_build_code() -> None:
    code = (
        "import sys\n"
        "import serve.runtime.engine, serve.runtime.cache, serve.api.decode, serve.api.batch\n"
        "import serve.worker\n"
        "import serve.sidecar.http.app, serve.metrics, serve.store.routing, serve.common.cpu\n"
        "import serve.metrics.worker, serve.metrics.aggregate, serve.metrics.sidecar\n"
        "import serve.metrics.deltas, serve.metrics.multiprocess, serve.phases, serve.rowformat\n"
        f"bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
        f"for f in {FORBIDDEN!r}))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pod modules loaded {proc.stdout.strip()}\n{proc.stderr[-2000:]}"


def _sidecar_files() -> list[Path]:
    return sorted((REPO / "serve" / "sidecar").rglob("*.py"))


def test_the_sidecar_has_its_layers() -> None:
    names = {p.name for p in (REPO / "serve" / "sidecar").iterdir()}
    assert {"http", "control", "adapters", "services"} <= names, sorted(names)
    flat = sorted(n for n in names if n.endswith(".py")
                  and n not in {"__init__.py", "__main__.py", "config.py", "root.py"})
    assert not flat, f"modules outside the sidecar's layers: {flat}"


def test_the_sidecar_package_imports_nothing() -> None:
    """The package module has no layer; it holds no import, so it needs no exemption."""
    init = REPO / "serve" / "sidecar" / "__init__.py"
    assert imports_of(init, "serve.sidecar") == []


@pytest.mark.parametrize("path", _sidecar_files(), ids=_ids)
def test_sidecar_imports_only_point_inwards(path: Path) -> None:
    """__main__ -> http -> root -> services -> control -> adapters -> config: a layer
    imports only the layers after it, never one before it."""
    bad = sidecar_violations(path, module_name(path))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("module", "source", "verdict"), [
    ("serve.sidecar.adapters._probe", "def f():\n    from serve.sidecar.http import app\n",
     "imports serve.sidecar.http.app"),
    ("serve.sidecar.config", "from serve.sidecar.control.tuner import BatchTuner\n",
     "imports serve.sidecar.control.tuner.BatchTuner"),
    ("serve.sidecar.control._probe", "from ..services import feedback\n",
     "imports serve.sidecar.services.feedback"),
])
def test_sidecar_layer_check_catches_an_import_back(tmp_path: Path, module: str, source: str,
                                                    verdict: str) -> None:
    """The checker itself: an adapter importing the HTTP edge, the config importing a
    controller, a controller importing a service are violations."""
    probe = tmp_path / "_layer_probe.py"
    probe.write_text(source)
    bad = sidecar_violations(probe, module)
    assert len(bad) == 1 and bad[0].endswith(verdict), bad


def test_sidecar_layer_check_passes_an_adapter_importing_the_config(tmp_path: Path) -> None:
    probe = tmp_path / "_layer_probe.py"
    probe.write_text("from serve.sidecar.config import SidecarConfig\nfrom serve.state import Batching\n")
    assert sidecar_violations(probe, "serve.sidecar.adapters._probe") == []
    assert floor_violations(probe, "serve.sidecar.adapters._probe", _serve()) == []


def test_only_the_shared_vocabulary_sits_at_the_top_of_serve() -> None:
    flat = sorted(p.name for p in (REPO / "serve").glob("*.py") if p.name not in TOP_OF_SERVE)
    assert not flat, f"modules at the top of serve/ that belong to a layer: {flat}"
