"""Lint the Dockerfile (no Docker engine here, so CI cannot build it): a base pinned by
digest, pinned apt packages, the serving requirements only (no TorchRec, FBGEMM, test or
lint tool) at the project's pins, a fixed non-root UID, no secrets, and image tags that
equal what `make image` builds and what k8s/ deploys; the image bakes the model
versions and starts TorchServe empty, as the pod does."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
UID = 10001
SERVE_REQS = REPO / "requirements-serve.txt"
DEV_REQS = REPO / "requirements-dev.txt"
CONSTRAINTS = REPO / "constraints.txt"
# What the pod never runs: test, load-test, lint and audit tools, and the offline build.
TOOLS = {"locust", "pytest", "mypy", "ruff", "matplotlib", "kubernetes-validate", "pip-audit"}
OFFLINE_BUILD = {"torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "torch-model-archiver",
                 "tensordict", "torchmetrics", "pyre-extensions"}
_PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument text) with line continuations joined, comments dropped."""
    lines: list[str] = []
    buf = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    out = []
    for line in lines:
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def pins_in(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for name, version in _PIN.findall(line):
            out[_norm(name)] = version
    return out


def project_pins() -> dict[str, str]:
    pins = pins_in(CONSTRAINTS.read_text())
    for path in (SERVE_REQS, DEV_REQS, REPO / "scripts" / "setup_venv.sh"):
        pins.update(pins_in(path.read_text()))
    return pins


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file (comments and blanks dropped)."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


def run_text() -> str:
    return "\n".join(arg for op, arg in instructions() if op == "RUN")


def test_every_pinned_version_equals_the_projects():
    pins = project_pins()
    docker = pins_in(run_text())
    assert set(docker) == {"torch"}, "the image pins torch per variant, the rest via the lists"
    for name, version in docker.items():
        assert pins[name] == version, f"{name}: Dockerfile {version} != project {pins[name]}"


def test_it_installs_the_serving_requirements_only():
    """The serving lock (requirements-serve.txt's closure, hashed) with constraints.txt,
    nothing else: no TorchRec, FBGEMM or dev list (the pod imports neither:
    tests/test_layers.py), and the build checks it."""
    run = run_text()
    assert "pip install --require-hashes -r requirements-serve.lock -c constraints.txt" in run
    copies = [shlex.split(arg)[:-1] for op, arg in instructions() if op == "COPY"]
    reqs = {src for c in copies for src in c if src.startswith("requirements")}
    assert reqs == {"requirements-serve.lock", "requirements-torch-cpu.lock"}
    for name in OFFLINE_BUILD - {"torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"}:
        assert name not in run, name
    assert "install --no-deps torchrec" not in run and "fbgemm-gpu==" not in run
    assert "must not contain torchrec or fbgemm_gpu" in run, "the build refuses them"
    assert "pip install --no-deps --no-build-isolation ." in run
    assert run.rstrip().count("pip check") == 1, "the installed set is consistent"


def _pip_installs() -> list[str]:
    """Every ``pip install ...`` command of the RUN lines, up to its ; && || or )."""
    return [m.group(0) for m in re.finditer(r"pip install [^;&|)]*", run_text())]


def test_every_pip_install_is_constrained_and_every_lock_hash_checked():
    """-c constraints.txt on every pip install but the project's own (--no-deps: it pulls
    nothing), the CPU torch line included; every -r of a lock with --require-hashes."""
    installs = _pip_installs()
    assert len(installs) >= 5, installs
    for cmd in installs:
        args = shlex.split(cmd)
        if args[-1] == "." and "--no-deps" in args:
            continue
        assert "-c" in args and args[args.index("-c") + 1] == "constraints.txt", cmd
        if "-r" in args:
            assert args[args.index("-r") + 1].endswith(".lock") and "--require-hashes" in args, cmd
    cpu = next(c for c in installs if "TORCH_CPU_INDEX" in c)
    assert "-r requirements-torch-cpu.lock" in cpu and "--require-hashes" in cpu


def test_serving_lock_pins_the_serving_closure_with_hashes():
    """requirements-serve.lock is the serving closure (what make lint audits) at the
    project's pins, torch aside, each with sha256 hashes; the CPU torch lock is the torch
    pin's +cpu build. `make lock` regenerates both (serve.ops.lock)."""
    from serve.ops.audit import serving_closure
    from serve.ops.lock import SERVE_LOCK, TORCH_CPU_LOCK, read_lock

    closure = {_norm(n): v for n, v in serving_closure(SERVE_REQS, CONSTRAINTS).items()}
    lock = read_lock(REPO / SERVE_LOCK)
    assert {n: v for n, (v, _) in lock.items()} == {n: v for n, v in closure.items()
                                                   if n != "torch"}
    assert all(hashes for _, hashes in lock.values())
    (torch_pin, hashes), = read_lock(REPO / TORCH_CPU_LOCK).values()
    assert torch_pin == closure["torch"] + "+cpu" and len(hashes) == 1
    assert "lock:" in (REPO / "Makefile").read_text() and "serve.ops.lock" in \
        (REPO / "Makefile").read_text()


def test_lock_hashes_come_from_the_index_page_of_that_version():
    """serve.ops.lock.file_hashes keeps only the pinned version's files (wheel names
    normalised, sdists too) and refuses a version the page lacks; a lock line without a
    hash does not read."""
    from serve.errors import ConfigError
    from serve.ops.lock import file_hashes, lock_text, read_lock

    a, b, c = "a" * 64, "b" * 64, "c" * 64
    page = (f'<a href="https://x/typing_extensions-4.16.0-py3-none-any.whl#sha256={a}">w</a>'
            f'<a href="https://x/typing_extensions-4.16.0.tar.gz#sha256={b}">s</a>'
            f'<a href="https://x/typing_extensions-4.15.0-py3-none-any.whl#sha256={c}">old</a>'
            '<a href="https://x/typing_extensions-4.16.0-py2-none-any.whl#md5=00">md5</a>')
    assert file_hashes(page, "typing-extensions", "4.16.0") == [a, b]
    with pytest.raises(ConfigError, match="4.17.0"):
        file_hashes(page, "typing-extensions", "4.17.0")
    text = lock_text([("typing-extensions", "4.16.0", [a, b])], "test")
    path = REPO / "build" / "test-lock-roundtrip.lock"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    assert read_lock(path) == {"typing-extensions": ("4.16.0", [a, b])}
    path.write_text("typing-extensions==4.16.0\n")
    with pytest.raises(ConfigError, match="--hash"):
        read_lock(path)
    path.unlink()


def test_apt_packages_are_pinned():
    """Every apt package is name=version, the versions in ARGs (bumped on purpose)."""
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    installs = [m.group(1) for m in re.finditer(r"apt-get install ([^&;]+)", run_text())]
    assert installs
    for cmd in installs:
        pkgs = [t.strip('"') for t in shlex.split(cmd) if not t.startswith("-")]
        assert pkgs
        for pkg in pkgs:
            name, sep, version = pkg.partition("=")
            assert sep and version, f"apt package {name} is not pinned (name=version)"
            var = re.fullmatch(r"\$\{(\w+)\}", version)
            assert var and args.get(var.group(1)), f"{name}: pin it through a defaulted ARG"
    assert re.search(r"~deb12u\d+$", args["JRE_VERSION"]), "a bookworm (Debian 12) build"


def _names(path: Path) -> set[str]:
    return {_norm(re.split(r"[=<>!~\[; ]", ln, maxsplit=1)[0]) for ln in requirement_lines(path)
            if not ln.startswith("-")}


def test_serving_requirements_name_no_test_or_lint_tool():
    serve = _names(SERVE_REQS)
    assert not serve & TOOLS, f"test/lint tools in requirements-serve.txt: {serve & TOOLS}"
    assert not serve & OFFLINE_BUILD, f"the offline build in the image: {serve & OFFLINE_BUILD}"
    assert {"torchserve", "fastapi", "uvicorn", "torch"} <= serve
    assert _names(DEV_REQS) >= TOOLS, "the dev list installs every tool (make venv)"


def test_requirement_lists_are_pinned_like_the_constraints():
    """Every line of both lists is name==version (or an include), at constraints.txt's
    version where it pins the same package; the dev list includes the serving one, and
    requirements.txt, setup_venv.sh and the Makefile use them."""
    constraints = pins_in(CONSTRAINTS.read_text())
    for path in (SERVE_REQS, DEV_REQS):
        for line in requirement_lines(path):
            if line.startswith("-r "):
                continue
            (name, version), = _PIN.findall(line) or [(line, "")]
            assert version and _PIN.fullmatch(line), f"{path.name}: {line!r} is not name==version"
            if _norm(name) in constraints:
                assert constraints[_norm(name)] == version, \
                    f"{name}: {path.name} {version} != constraints.txt {constraints[_norm(name)]}"
    assert "-r requirements-serve.txt" in requirement_lines(DEV_REQS)
    assert "-r requirements-dev.txt" in requirement_lines(REPO / "requirements.txt")
    assert "-r requirements-dev.txt -c constraints.txt" in \
        (REPO / "scripts" / "setup_venv.sh").read_text()
    stamp = next(ln for ln in (REPO / "Makefile").read_text().splitlines()
                 if ln.startswith("$(VENV)/.stamp:"))
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-serve.txt",
                 "constraints.txt"):
        assert name in stamp.split(), f"make venv must rerun when {name} changes"


def test_serving_closure_holds_no_tool():
    """Offline: requirements-serve.txt and everything it requires (the installed
    packages' metadata), each pinned: no tool, no TorchRec, no FBGEMM."""
    from serve.ops.audit import serving_closure

    closure = {_norm(n) for n in serving_closure(SERVE_REQS, CONSTRAINTS)}
    assert not closure & (TOOLS | OFFLINE_BUILD), closure & (TOOLS | OFFLINE_BUILD)
    assert {"torchserve", "fastapi", "starlette", "pydantic", "h11"} <= closure


def _pip_dry_run(tmp_path: Path, args: list[str], *, timeout: int
                 ) -> tuple[subprocess.CompletedProcess, Path]:
    """``pip install --dry-run --report`` of ``args`` for a fresh empty venv (nothing
    installed; needs the package index): pip's result and its report's path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *args],
        capture_output=True, text=True, timeout=timeout, check=False)
    return out, report


def _installed(report: Path) -> set[str]:
    """The normalized names of what a pip ``--report`` would install."""
    return {_norm(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_an_environment_from_the_serving_requirements_has_no_tool(tmp_path):
    """pip resolves requirements-serve.txt + constraints.txt for a fresh venv (--dry-run
    --report: nothing installed; needs the package index): no tool, and the same packages
    the offline closure walks (what make lint audits)."""
    from serve.ops.audit import serving_closure

    out, report = _pip_dry_run(tmp_path, ["-r", str(SERVE_REQS), "-c", str(CONSTRAINTS)],
                               timeout=600)
    if out.returncode != 0 and not report.exists():
        pytest.fail(f"pip could not resolve the serving requirements: {out.stderr[-2000:]}")
    names = _installed(report)
    assert not names & (TOOLS | OFFLINE_BUILD), names & (TOOLS | OFFLINE_BUILD)
    assert names == {_norm(n) for n in serving_closure(SERVE_REQS, CONSTRAINTS)}


@pytest.mark.slow
def test_the_serving_lock_resolves_with_require_hashes(tmp_path):
    """pip resolves requirements-serve.lock alone in hash-checking mode, as the image's
    build does (--require-hashes -c constraints.txt; --dry-run --report: nothing
    installed; needs the package index): every package it needs is in the lock with
    its hashes, and it installs exactly the lock's packages."""
    from serve.ops.lock import SERVE_LOCK, read_lock

    out, report = _pip_dry_run(tmp_path, ["--require-hashes", "-r", str(REPO / SERVE_LOCK),
                                          "-c", str(CONSTRAINTS)], timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    names = _installed(report)
    assert names == set(read_lock(REPO / SERVE_LOCK))


def test_python_matches_the_venv():
    """The base's CPython minor version is the venv's (the pins were resolved for it)."""
    args = {op: arg for op, arg in instructions() if op == "ARG" and arg.startswith("PYTHON_IMAGE")}
    m = re.search(r"python:(\d+)\.(\d+)", args["ARG"])
    assert m and (int(m[1]), int(m[2])) == sys.version_info[:2]


def test_thread_count_is_left_to_the_cpu_quota():
    """OMP_NUM_THREADS in the image would override serve/common/cpu.py's quota rule for every
    model (tests/test_k8s.py checks the manifests the same way)."""
    envs = " ".join(arg for op, arg in instructions() if op == "ENV")
    assert "OMP_NUM_THREADS" not in envs


def test_runs_as_the_fixed_non_root_uid():
    users = [arg for op, arg in instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] == str(UID)
    assert f"--uid {UID}" in run_text()
    dep = next(d for d in yaml.safe_load_all((REPO / "k8s" / "deployment.yaml").read_text())
               if d and d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == UID


def test_entrypoint_forwards_signals_and_torchserve_stays_in_the_foreground():
    ops = {op: arg for op, arg in instructions() if op in ("ENTRYPOINT", "CMD")}
    assert ops["ENTRYPOINT"].replace(" ", "") == '["/usr/bin/tini","-g","--"]'
    assert '"--foreground"' in ops["CMD"] and '"--start"' in ops["CMD"]
    assert "tini" in run_text()


def test_no_secrets_in_the_image():
    secretish = re.compile(r"(TOKEN|SECRET|PASSW|PASSWORD|API_?KEY|CREDENTIAL|PRIVATE)", re.IGNORECASE)
    for op, arg in instructions():
        if op in ("ENV", "ARG"):
            for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", arg) or [arg.split()[0]]:
                assert not secretish.search(name), f"{op} {name}: secrets come from a Secret"
        if op in ("COPY", "ADD"):
            srcs = shlex.split(arg)[:-1]
            for src in srcs:
                assert not src.startswith((".run", "key_file", ".git", ".env")), src
                assert "token" not in src.lower(), src
        assert op != "ADD", "use COPY (ADD fetches URLs and unpacks archives implicitly)"
    ignore = dockerignore_patterns()
    for must in (".run", "key_file.json", ".git", ".venv", ".env"):
        assert must in ignore, f".dockerignore must exclude {must}"


def dockerignore_patterns() -> list[str]:
    """The .dockerignore patterns: one per line; blank lines and # comments skipped."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_copied_sources_exist_and_are_not_ignored():
    ignore = [p.rstrip("/") for p in dockerignore_patterns()]
    for op, arg in instructions():
        if op != "COPY":
            continue
        for src in shlex.split(arg)[:-1]:
            assert (REPO / src).exists(), f"COPY {src}: not in the repo"
            assert src.rstrip("/") not in ignore, f"COPY {src} but .dockerignore drops it"


def _make_image_tag(variant: str) -> str:
    make = shutil.which("make")
    if make is None:
        pytest.fail("make is needed (it is the project's interface)")
    # Under `make test` the environment carries MAKEFLAGS/MAKELEVEL, and a nested make
    # then prints "Entering/Leaving directory" lines around the recipe: drop both.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run([make, "--no-print-directory", "-n", "image", f"VARIANT={variant}"],
                         cwd=REPO, check=False, capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout.strip().splitlines()[-1])
    assert cmd[:2] == ["docker", "build"] and f"VARIANT={variant}" in cmd
    return cmd[cmd.index("-t") + 1]


def test_k8s_images_equal_what_make_image_builds():
    """k8s/ deploys the tags `make image` builds, each by digest (tag@sha256:...): the
    GPU tag in every container of the Deployment, the -cpu tag in the overlay."""
    gpu, cpu = _make_image_tag("gpu"), _make_image_tag("cpu")
    assert cpu == gpu + "-cpu"
    dep = next(d for d in yaml.safe_load_all((REPO / "k8s" / "deployment.yaml").read_text())
               if d and d["kind"] == "Deployment")
    spec = dep["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        assert re.fullmatch(re.escape(gpu) + r"@sha256:[0-9a-f]{64}", c["image"]), c["name"]
    kust = yaml.safe_load((REPO / "k8s" / "cpu" / "kustomization.yaml").read_text())
    (img,) = kust["images"]
    assert f"{img['name']}:{img['newTag']}" == cpu
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", img["digest"])


def test_every_k8s_image_is_by_digest():
    """Every image: line in k8s/ (templates too) and the overlay's image carry @sha256:
    (a tag can be re-pushed, a digest cannot)."""
    from serve.ops.release import image_refs

    lines = [ln.strip() for p in (REPO / "k8s").rglob("*.yaml")
             for ln in p.read_text().splitlines() if re.match(r"\s*-?\s*image:\s", ln)]
    assert len(lines) >= 3
    for ln in lines:
        assert re.search(r"@sha256:[0-9a-f]{64}$", ln), ln
    refs = image_refs(REPO / "k8s")
    assert len(refs) == len(lines) + 1
    assert all(re.search(r"@sha256:[0-9a-f]{64}$", r) for r in refs), refs


def test_release_step_writes_the_pushed_digests(tmp_path):
    """make release-manifests (serve.ops.release) on a copy of k8s/: every reference
    becomes the pushed image's name:tag@digest, comments kept; --check refuses the
    UNRELEASED digest and accepts released ones; a bad digest is refused."""
    from serve.errors import ConfigError
    from serve.ops.release import UNRELEASED, image_refs, main, write_digests

    k8s = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", k8s)
    gpu, cpu = "sha256:" + "1f" * 32, "sha256:" + "2e" * 32
    with pytest.raises(ConfigError, match="sha256"):
        write_digests(k8s, "reg.example/dlrm-serve", "0.2.0", "sha256:abc", cpu)
    write_digests(k8s, "reg.example/dlrm-serve", "0.2.0", UNRELEASED, UNRELEASED)
    assert main(["--k8s", str(k8s), "--check"]) == 1
    changed = write_digests(k8s, "reg.example/dlrm-serve", "0.2.0", gpu, cpu)
    assert k8s / "deployment.yaml" in changed and k8s / "cpu" / "kustomization.yaml" in changed
    refs = image_refs(k8s)
    assert refs[-1] == f"reg.example/dlrm-serve:0.2.0-cpu@{cpu}"
    assert set(refs[:-1]) == {f"reg.example/dlrm-serve:0.2.0@{gpu}"}
    assert main(["--k8s", str(k8s), "--check"]) == 0
    text = (k8s / "deployment.yaml").read_text()
    assert text.count("#") == (REPO / "k8s" / "deployment.yaml").read_text().count("#")
    kubectl = shutil.which("kubectl")
    if kubectl is not None:  # what the overlay really deploys
        out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone",
                              str(k8s / "cpu")], capture_output=True, text=True, check=True,
                             timeout=60)
        images = set(re.findall(r"image: (\S+)", out.stdout))
        assert images == {f"reg.example/dlrm-serve:0.2.0-cpu@{cpu}"}, images


def test_make_scan_says_not_scanned_without_scanners(tmp_path):
    """Without trivy, grype or a reachable audit service every line says NOT SCANNED,
    never clean; 0 by default, 2 with --strict; a scanner that finds something fails (1)
    and one that cannot reach its database is NOT SCANNED."""
    make = shutil.which("make")
    assert make is not None
    dry = subprocess.run([make, "--no-print-directory", "-n", "scan", "SCAN_STRICT=1"],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    assert "-m serve.ops.scan --image dlrm-serve:0.1.0 --strict" in dry.stdout
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bindir}:/usr/bin:/bin", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "serve.ops.scan", "--image", "dlrm-serve:0.1.0",
           "--pip-audit", str(tmp_path / "no-pip-audit"), "--timeout-s", "30"]

    def scan(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd + list(extra), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120, check=False)

    out = scan()
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert text.count("NOT SCANNED") == 4 and "clean" not in text.replace("not a clean", "")
    assert "trivy is not installed" in text and "grype is not installed" in text
    assert scan("--strict").returncode == 2
    for tool, code in (("trivy", 1), ("grype", 3)):
        (bindir / tool).write_text(f"#!/bin/sh\necho finding-from-{tool}\nexit {code}\n")
        (bindir / tool).chmod(0o755)
    out = scan()
    assert out.returncode == 1, out.stderr
    assert "scan os+jars (trivy): VULNERABLE (trivy: finding-from-trivy)" in out.stderr
    assert "scan os+jars (grype): NOT SCANNED (grype exit 3" in out.stderr


def _deployment() -> dict:
    return next(d for d in yaml.safe_load_all((REPO / "k8s" / "deployment.yaml").read_text())
                if d and d["kind"] == "Deployment")


def _pod_container(name: str) -> dict:
    return next(c for c in _deployment()["spec"]["template"]["spec"]["containers"]
                if c["name"] == name)


def test_cmd_is_the_pods_torchserve_and_starts_it_empty():
    """The image's CMD is exactly the pod's torchserve command: no --models (the sidecar
    registers the version the serving state names), a model store UID 10001 can write."""
    cmd = json.loads(dict(instructions())["CMD"])
    assert cmd == _pod_container("torchserve")["args"]
    assert "--models" not in cmd and not any(a.endswith(".mar") for a in cmd)
    store = cmd[cmd.index("--model-store") + 1]
    made = [arg for op, arg in instructions() if op == "RUN" and "mkdir -p" in arg and store in arg]
    assert made and f"chown {UID}:{UID}" in made[0], f"{store} must exist, owned by {UID}"


def test_baked_versions_are_the_sidecars_first_repository():
    """COPY model_store/ bakes every built version where the sidecar looks first."""
    copies = [shlex.split(arg) for op, arg in instructions() if op == "COPY"]
    (dest,) = [c[1] for c in copies if c[0] == "model_store/"]
    args = _pod_container("sidecar")["args"]
    repos = [args[i + 1] for i, a in enumerate(args) if a == "--repository"]
    assert repos and repos[0] == dest.rstrip("/")


def test_dockerignore_bakes_versions_but_not_the_sidecars_derived_archives():
    """model_store/ locally is also TorchServe's store, where the sidecar writes archives
    per serving version: those (and half-written files) stay out of the image."""
    from serve.sidecar.adapters.archives import mar_path
    from serve.state import serving_version
    from serve.store.repository import ModelRepository

    patterns = dockerignore_patterns()

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, p.rstrip("/")) for p in patterns)

    repo = ModelRepository([Path("model_store")])
    version = "small-int8-s0"
    for kept in (f"model_store/{repo.archive_name(version)}", f"model_store/dlrm-{version}.json"):
        assert not ignored(kept), kept
    derived = mar_path(Path("model_store"), "dlrm", serving_version(version, 8, 5, 2))
    assert ignored(derived.as_posix()), derived
    assert ignored(f"model_store/.{repo.archive_name(version)}.tmp")
