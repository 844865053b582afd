"""Lint the Dockerfile (no Docker engine here, so CI cannot build it): the same pinned
stack as scripts/setup_venv.sh, a fixed non-root UID, no secrets, and image tags that
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
    pins = pins_in((REPO / "constraints.txt").read_text())
    pins.update(pins_in((REPO / "requirements.txt").read_text()))
    pins.update(pins_in((REPO / "scripts" / "setup_venv.sh").read_text()))
    return pins


def run_text() -> str:
    return "\n".join(arg for op, arg in instructions() if op == "RUN")


def test_every_pinned_version_equals_the_projects():
    pins = project_pins()
    docker = pins_in(run_text())
    assert {"torch", "fbgemm-gpu-cpu", "fbgemm-gpu", "torchrec"} <= set(docker)
    for name, version in docker.items():
        if name == "fbgemm-gpu":  # the CUDA build of the same fbgemm release as the CPU one
            assert version == pins["fbgemm-gpu-cpu"], name
            continue
        assert name in pins, f"the Dockerfile pins {name}=={version}, the project does not"
        assert pins[name] == version, f"{name}: Dockerfile {version} != project {pins[name]}"


def test_it_installs_the_same_stack_as_setup_venv():
    run = run_text()
    # Everything setup_venv.sh pins on the command line is pinned here too.
    for name, version in pins_in((REPO / "scripts" / "setup_venv.sh").read_text()).items():
        assert f"{name}=={version}" in run, name
    assert "--no-deps torchrec==" in run, "torchrec must go in with --no-deps (docs/stack.md)"
    assert "-r /tmp/requirements-image.txt -c constraints.txt" in run
    # The only requirements the image drops are the fbgemm build it replaces per variant.
    m = re.search(r"grep -v '([^']+)' requirements.txt > /tmp/requirements-image.txt", run)
    assert m, "the image installs requirements.txt (minus fbgemm) with constraints.txt"
    dropped = [line for line in (REPO / "requirements.txt").read_text().splitlines()
               if re.match(m.group(1), line)]
    assert [_norm(line.split("==")[0]) for line in dropped] == ["fbgemm-gpu-cpu"]
    assert "--no-deps" in run and "pip install --no-deps --no-build-isolation ." in run


def test_python_matches_the_venv():
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
    gpu, cpu = _make_image_tag("gpu"), _make_image_tag("cpu")
    assert cpu == gpu + "-cpu"
    dep = next(d for d in yaml.safe_load_all((REPO / "k8s" / "deployment.yaml").read_text())
               if d and d["kind"] == "Deployment")
    spec = dep["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        assert c["image"] == gpu, c["name"]
    kust = yaml.safe_load((REPO / "k8s" / "cpu" / "kustomization.yaml").read_text())
    (img,) = kust["images"]
    assert f"{img['name']}:{img['newTag']}" == cpu


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
