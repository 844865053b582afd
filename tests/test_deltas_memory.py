"""A large embedding delta posted to a real sidecar process running under a 512 MiB
memory cgroup (v1; needs root): the sidecar streams it to the delta folder and validates
it through mmap, so it is stored (202: no TorchServe workers here to apply it) or refused
with 413, and the sidecar is never killed. The peak RSS (VmHWM) and the cgroup's
``memory.max_usage_in_bytes`` are printed (``-s``) as one JSON line.

The suite posts a 48 MB delta; ``DLRM_DELTA_MEASURE_MB=400`` posts 400 MB (what the
default --max-delta-bytes and the sidecar's memory limit were sized from), and
``DLRM_DELTA_MEASURE_DIR=/dev/shm`` puts the delta folder on tmpfs (a memory-backed
emptyDir: its pages are charged to the cgroup of the process that writes them).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from serve.common.net import free_port, free_ports, wait_until
from serve.state import Batching, DesiredState, ModelRef, write_state
from serve.store.deltas.format import file_sha256, version_digest
from serve.store.repository import ModelRepository
from tests.fixtures.big_delta import (
    BIG_PROFILE,
    cgroup_stat,
    make_memory_cgroup,
    remove_cgroup,
    start_sidecar_in,
    vm_hwm_bytes,
    write_big_delta,
)
from tests.fixtures.sidecar import toy_mar

pytestmark = pytest.mark.integration

LIMIT = 512 << 20
VERSION = "ck-int8-s0"
REPORT = {"created_at": "2026-01-01T00:00:00Z", "version": VERSION, "profile": BIG_PROFILE,
          "quantized_dtype": "int8"}
TOKEN = "memory-token-0123456789abcdef0123456789"
MIB = float(1 << 20)


def _setup(tmp_path: Path, delta_root: Path) -> tuple[list[str], Path]:
    root = tmp_path / "repo"
    root.mkdir()
    ModelRepository([root]).add(VERSION, toy_mar(tmp_path / "src.mar", version=VERSION),
                                REPORT)
    state = tmp_path / "state.yaml"
    write_state(state, DesiredState(model=ModelRef(version=VERSION),
                                    batching=Batching(batch_size=8, max_batch_delay_ms=5),
                                    workers=1))
    (tmp_path / "token").write_text(TOKEN)
    delta_dir = delta_root / f"wt-deltas-mem-{os.getpid()}-{tmp_path.name}"
    dead = f"http://127.0.0.1:{free_port()}"  # no TorchServe: nothing applies the delta
    args = ["--management-url", dead, "--inference-url", dead, "--metrics-url", dead,
            "--token-file", str(tmp_path / "token"), "--state-file", str(state),
            "--repository", str(root), "--model-store", str(tmp_path / "store"),
            "--delta-dir", str(delta_dir), "--cgroup-root", str(tmp_path / "no-cgroup"),
            "--log-level", "warning"]
    return args, delta_dir


def _wait_serving(url: str) -> None:
    """Until the sidecar at ``url`` answers and serves :data:`VERSION` (deltas accepted)."""
    wait_until(lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200,
               timeout_s=60, what="the sidecar", interval_s=0.2)
    wait_until(lambda: VERSION in json.dumps(httpx.get(f"{url}/embeddings/deltas",
                                                       timeout=5).json()),
               timeout_s=30, what="the served version", interval_s=0.1)


def test_a_large_delta_fits_a_512_mib_sidecar(tmp_path: Path) -> None:
    size_mb = int(os.environ.get("DLRM_DELTA_MEASURE_MB", "48"))
    delta_root = Path(os.environ.get("DLRM_DELTA_MEASURE_DIR", str(tmp_path)))
    cgroup, why = make_memory_cgroup(f"wt-deltas-{os.getpid()}", LIMIT)
    if cgroup is None:
        pytest.skip(f"needs a memory cgroup to measure in (root, cgroup v1): {why}")
    body = tmp_path / "big.delta"
    size = write_big_delta(body, VERSION, size_mb * 1_000_000)
    args, delta_dir = _setup(tmp_path, delta_root)
    port, write_port = free_ports(2)
    sidecar = start_sidecar_in(cgroup, args, port, tmp_path / "sidecar.log", write_port)
    try:
        _wait_serving(sidecar.url)
        idle_hwm = vm_hwm_bytes(sidecar.pid)
        t0 = time.monotonic()
        with open(body, "rb") as f:
            r = httpx.post(f"{sidecar.write_url}/embeddings/deltas", params={"wait_s": 0},
                           content=iter(lambda: f.read(1 << 20), b""), timeout=300,
                           headers={"Authorization": f"Bearer {TOKEN}"})
        seconds = time.monotonic() - t0
        assert r.status_code in (202, 413), r.text
        assert sidecar.proc.poll() is None, "the sidecar was killed"
        assert httpx.get(f"{sidecar.url}/healthz", timeout=5).status_code == 200
        hwm, cg = vm_hwm_bytes(sidecar.pid), cgroup_stat(cgroup)
        stored = delta_dir / VERSION / "00000001.delta"
        if r.status_code == 202:
            assert stored.stat().st_size == size
        print(json.dumps({
            "delta_bytes": size, "delta_dir": str(delta_root), "status": r.status_code,
            "post_seconds": round(seconds, 2),
            "idle_vm_hwm_mib": round(idle_hwm / MIB, 1), "vm_hwm_mib": round(hwm / MIB, 1),
            "cgroup_max_usage_mib": round(cg["memory.max_usage_in_bytes"] / MIB, 1),
            "cgroup_usage_after_mib": round(cg["memory.usage_in_bytes"] / MIB, 1),
            "cgroup_failcnt": cg["memory.failcnt"],
            "oom_kill": cg.get("oom_control.oom_kill", 0)}))
        assert cg.get("oom_control.oom_kill", 0) == 0
        assert hwm < LIMIT
    finally:
        sidecar.stop()
        import shutil
        shutil.rmtree(delta_dir, ignore_errors=True)
        remove_cgroup(cgroup)


def test_the_store_bound_keeps_a_memory_backed_sidecar_alive(tmp_path: Path) -> None:
    """Deltas stay in the (memory-backed) folder until their version stops being served:
    one delta fits, but a pile of them would not. With --max-delta-store-bytes at two
    deltas, the third is refused with 507 before a byte of it is stored, and the
    sidecar, in a cgroup sized for two, lives. The delta folder is /dev/shm (tmpfs:
    charged to the sidecar like a memory-backed emptyDir) where it exists.

    The suite posts 3 x 32 MB under 256 MiB; ``DLRM_DELTA_MEASURE_MB=256`` posts
    3 x 256 MiB under 1 GiB (the shipped defaults and the sidecar container's limit)."""
    size_mb = int(os.environ.get("DLRM_DELTA_MEASURE_MB", "32"))
    limit = (1 << 30) if size_mb > 100 else (256 << 20)
    shm = Path("/dev/shm")
    delta_root = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    cgroup, why = make_memory_cgroup(f"store-bound-{os.getpid()}", limit)
    if cgroup is None:
        pytest.skip(f"needs a memory cgroup to measure in (root, cgroup v1): {why}")
    bodies: list[Path] = []
    for seq in (1, 2, 3):  # one chain: each names the file before it
        parent = file_sha256(bodies[-1]) if bodies else version_digest(REPORT)
        bodies.append(tmp_path / f"{seq}.delta")
        write_big_delta(bodies[-1], VERSION, size_mb * (1 << 20) - 4096, sequence=seq,
                        seed=seq, parent=parent)
    one = max(p.stat().st_size for p in bodies)
    args, delta_dir = _setup(tmp_path, delta_root)
    args += ["--max-delta-bytes", str(one), "--max-delta-store-bytes", str(2 * one)]
    port, write_port = free_ports(2)
    sidecar = start_sidecar_in(cgroup, args, port, tmp_path / "sidecar.log", write_port)
    codes = []
    try:
        _wait_serving(sidecar.url)
        for body in bodies:
            with open(body, "rb") as f:
                r = httpx.post(f"{sidecar.write_url}/embeddings/deltas", params={"wait_s": 0},
                               content=f.read(), timeout=300,
                               headers={"Authorization": f"Bearer {TOKEN}"})
            codes.append(r.status_code)
            if r.status_code == 507:
                assert r.json()["type"] == "InsufficientMemory"
                assert "--max-delta-store-bytes" in r.json()["message"]
        assert sidecar.proc.poll() is None, "the sidecar was killed"
        hwm, cg = vm_hwm_bytes(sidecar.pid), cgroup_stat(cgroup)
        print(json.dumps({
            "delta_bytes": one, "store_bound": 2 * one, "delta_dir": str(delta_root),
            "codes": codes, "cgroup_limit_mib": limit / MIB,
            "vm_hwm_mib": round(hwm / MIB, 1),
            "cgroup_max_usage_mib": round(cg["memory.max_usage_in_bytes"] / MIB, 1),
            "oom_kill": cg.get("oom_control.oom_kill", 0)}))
        assert codes == [202, 202, 507]
        assert sorted(p.name for p in (delta_dir / VERSION).glob("*.delta")) == [
            "00000001.delta", "00000002.delta"]
        assert not list(delta_dir.glob(".incoming.*"))
        assert cg.get("oom_control.oom_kill", 0) == 0
    finally:
        sidecar.stop()
        import shutil
        shutil.rmtree(delta_dir, ignore_errors=True)
        remove_cgroup(cgroup)
