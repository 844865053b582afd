"""serve.sidecar.adapters.gpu: GPU utilization and memory through NVML, with a fake pynvml (exact
values), with the real one on this machine (disabled without a GPU, exported with one),
failing reads, the sidecar's registry, and the real sidecar process under uvicorn."""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from serve.metrics import GPU_MEMORY_TOTAL_BYTES, GPU_MEMORY_USED_BYTES, GPU_UTILIZATION_RATIO
from serve.sidecar.adapters.gpu import ERROR_LOG_INTERVAL_S, GpuCollector
from serve.sidecar.config import SidecarConfig
from serve.sidecar.root import Sidecar
from tests.fixtures.sidecar import dead_port, start_sidecar
from tests.promtext import samples

FAKE_DIR = Path(__file__).resolve().parent / "fixtures" / "fake_nvml"
GIB = 1 << 30
DISABLED_LINE = "no NVIDIA GPU/driver: GPU metrics not exported ("


def fake_nvml(monkeypatch: pytest.MonkeyPatch, devices: int = 1) -> ModuleType:
    """A fresh copy of tests/fixtures/fake_nvml/pynvml.py (its own init count) with
    ``devices`` GPUs."""
    monkeypatch.setenv("DLRM_FAKE_NVML_DEVICES", str(devices))
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE_DIR / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exposition(collector: GpuCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return samples(generate_latest(registry).decode())


def gpu_samples(got: dict[tuple[str, tuple], float]) -> dict[tuple[str, tuple], float]:
    return {k: v for k, v in got.items() if k[0].startswith("dlrm_gpu_")}


def expected(device: int) -> dict[tuple[str, tuple], float]:
    labels = (("device", str(device)),)
    return {(GPU_UTILIZATION_RATIO, labels): (37 + device) / 100,
            (GPU_MEMORY_USED_BYTES, labels): float((3 + device) * GIB),
            (GPU_MEMORY_TOTAL_BYTES, labels): float(80 * GIB)}


# ------------------------------------------------------------------ fake NVML


def test_one_fake_gpu_exports_the_three_families_exactly(monkeypatch):
    collector = GpuCollector(fake_nvml(monkeypatch, 1))
    assert collector.enabled and collector.device_count == 1 and collector.reason is None
    text = generate_latest(_registry(collector)).decode()
    assert 'dlrm_gpu_utilization_ratio{device="0"} 0.37\n' in text
    assert 'dlrm_gpu_memory_used_bytes{device="0"} 3.221225472e+09\n' in text
    assert 'dlrm_gpu_memory_total_bytes{device="0"} 8.589934592e+10\n' in text
    assert "# TYPE dlrm_gpu_utilization_ratio gauge" in text
    assert gpu_samples(samples(text)) == expected(0)


def test_two_fake_gpus_are_labelled_by_index(monkeypatch):
    collector = GpuCollector(fake_nvml(monkeypatch, 2))
    assert collector.device_count == 2
    assert gpu_samples(exposition(collector)) == {**expected(0), **expected(1)}


def test_close_shuts_nvml_down_once_and_exports_nothing_after(monkeypatch):
    nvml = fake_nvml(monkeypatch, 1)
    collector = GpuCollector(nvml)
    collector.close()
    collector.close()  # harmless
    assert not collector.enabled and collector.reason == "closed"
    assert list(collector.collect()) == []
    with pytest.raises(nvml.NVMLError, match="Uninitialized"):  # shut down exactly once
        nvml.nvmlDeviceGetCount()


def test_registering_does_not_call_nvml(monkeypatch):
    nvml = fake_nvml(monkeypatch, 1)
    collector = GpuCollector(nvml)
    calls: list[int] = []
    monkeypatch.setattr(nvml, "nvmlDeviceGetHandleByIndex", lambda i: calls.append(i))
    CollectorRegistry().register(collector)
    assert collector.describe() == [] and calls == []


# ------------------------------------------------------------------ the real pynvml here


def _real_gpu_count() -> int:
    """What the real NVML says, asked directly: 0 when it cannot initialize."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def test_real_pynvml_disabled_without_a_gpu_exported_with_one(caplog):
    gpus = _real_gpu_count()
    with caplog.at_level(logging.INFO, logger="serve.sidecar.adapters.gpu"):
        collector = GpuCollector()  # the default: the real pynvml; must not raise
    try:
        got = exposition(collector)
        if gpus == 0:  # this machine: no NVIDIA driver
            assert not collector.enabled
            assert list(collector.collect()) == []
            assert not any(name.startswith("dlrm_gpu_") for name, _ in got)
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 1 and lines[0].startswith(DISABLED_LINE), lines
            assert collector.reason and collector.reason in lines[0]
        else:  # a GPU machine: every device has all three values
            assert collector.enabled and collector.device_count == gpus
            for i in range(gpus):
                labels = (("device", str(i)),)
                assert 0.0 <= got[(GPU_UTILIZATION_RATIO, labels)] <= 1.0
                total = got[(GPU_MEMORY_TOTAL_BYTES, labels)]
                assert 0 <= got[(GPU_MEMORY_USED_BYTES, labels)] <= total and total > GIB
    finally:
        collector.close()


# ------------------------------------------------------------------ failures


def test_nvml_init_failure_disables_without_raising(monkeypatch, caplog):
    nvml = fake_nvml(monkeypatch, 1)

    def no_driver() -> None:
        raise nvml.NVMLError(nvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(nvml, "nvmlInit", no_driver)
    with caplog.at_level(logging.INFO, logger="serve.sidecar.adapters.gpu"):
        collector = GpuCollector(nvml)
    assert not collector.enabled
    assert collector.reason == "nvmlInit failed: NVMLError: NVML Shared Library Not Found"
    assert [r.getMessage() for r in caplog.records] == [
        ("no NVIDIA GPU/driver: GPU metrics not exported (nvmlInit failed: NVMLError: "
         "NVML Shared Library Not Found)")]
    assert list(collector.collect()) == []
    assert gpu_samples(exposition(collector)) == {}
    collector.close()  # harmless when disabled


def test_zero_devices_disables_and_shuts_nvml_down(monkeypatch, caplog):
    nvml = fake_nvml(monkeypatch, 0)
    with caplog.at_level(logging.INFO, logger="serve.sidecar.adapters.gpu"):
        collector = GpuCollector(nvml)
    assert not collector.enabled and collector.reason == "NVML found 0 devices"
    assert [r.getMessage() for r in caplog.records] == [
        "no NVIDIA GPU/driver: GPU metrics not exported (NVML found 0 devices)"]
    assert gpu_samples(exposition(collector)) == {}
    with pytest.raises(nvml.NVMLError):  # the init was undone
        nvml.nvmlDeviceGetCount()


def test_missing_package_disables(monkeypatch, caplog):
    def no_package() -> ModuleType:
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr("serve.sidecar.adapters.gpu.load_pynvml", no_package)
    with caplog.at_level(logging.INFO, logger="serve.sidecar.adapters.gpu"):
        collector = GpuCollector()
    assert not collector.enabled
    assert [r.getMessage() for r in caplog.records] == [
        ("no NVIDIA GPU/driver: GPU metrics not exported (cannot import pynvml: No module "
         "named 'pynvml'; install nvidia-ml-py)")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_failing_device_read_drops_that_value_only_and_logs_once_a_minute(
        monkeypatch, caplog):
    nvml = fake_nvml(monkeypatch, 2)
    real_rates = nvml.nvmlDeviceGetUtilizationRates

    def rates(handle):
        if handle.index == 0:
            raise nvml.NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)
        return real_rates(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceGetUtilizationRates", rates)
    clock = Clock()
    collector = GpuCollector(nvml, clock=clock)
    want = {**expected(0), **expected(1)}
    del want[(GPU_UTILIZATION_RATIO, (("device", "0"),))]
    with caplog.at_level(logging.WARNING, logger="serve.sidecar.adapters.gpu"):
        assert gpu_samples(exposition(collector)) == want
        assert gpu_samples(exposition(collector)) == want  # no raise, same answer
        clock.now += ERROR_LOG_INTERVAL_S - 1
        assert gpu_samples(exposition(collector)) == want
        assert collector.read_errors == 3
        assert [r.getMessage() for r in caplog.records] == [
            ("GPU metrics: 1 NVML read(s) failed (values left out of the scrape); last: "
             "device 0 nvmlDeviceGetUtilizationRates: NVMLError: GPU is lost")]
        clock.now += 1
        exposition(collector)
        assert [r.getMessage()[:34] for r in caplog.records] == [
            "GPU metrics: 1 NVML read(s) failed", "GPU metrics: 3 NVML read(s) failed"]


def test_a_lost_device_handle_and_an_unexpected_error_never_break_the_scrape(monkeypatch):
    nvml = fake_nvml(monkeypatch, 2)
    real_handle = nvml.nvmlDeviceGetHandleByIndex

    def handle(index):
        if index == 1:
            raise nvml.NVMLError(nvml.NVML_ERROR_GPU_IS_LOST)
        return real_handle(index)

    def memory(handle, version=None):
        raise RuntimeError("ctypes went wrong")

    monkeypatch.setattr(nvml, "nvmlDeviceGetHandleByIndex", handle)
    monkeypatch.setattr(nvml, "nvmlDeviceGetMemoryInfo", memory)
    collector = GpuCollector(nvml)
    assert gpu_samples(exposition(collector)) == {
        (GPU_UTILIZATION_RATIO, (("device", "0"),)): 0.37}
    assert collector.read_errors == 2


# ------------------------------------------------------------------ the sidecar's registry


def test_sidecar_state_registers_the_gpu_collector(monkeypatch, tmp_path):
    registry = CollectorRegistry()
    state = Sidecar.create(SidecarConfig(model_store=tmp_path), registry=registry,
                                nvml=fake_nvml(monkeypatch, 2))
    assert state.gpu is not None and state.gpu.enabled
    got = samples(generate_latest(state.registry).decode())
    assert gpu_samples(got) == {**expected(0), **expected(1)}  # once each, not twice
    other = Sidecar.create(SidecarConfig(model_store=tmp_path),
                                nvml=fake_nvml(monkeypatch, 1))
    assert other.gpu is not state.gpu
    assert gpu_samples(samples(generate_latest(other.registry).decode())) == expected(0)
    assert gpu_samples(samples(generate_latest(registry).decode())) == {
        **expected(0), **expected(1)}


def test_sidecar_state_without_a_gpu_exports_no_gpu_series(tmp_path):
    if _real_gpu_count():
        pytest.skip("this machine has an NVIDIA GPU; the real-pynvml test covers it")
    state = Sidecar.create(SidecarConfig(model_store=tmp_path))
    assert state.gpu is not None and not state.gpu.enabled
    assert b"dlrm_gpu_" not in generate_latest(state.registry)


# ------------------------------------------------------------------ uvicorn


@pytest.mark.integration
def test_real_sidecar_exports_fake_gpus_from_pythonpath(monkeypatch, tmp_path):
    """The dashboard test's setup: the real sidecar process, the fake pynvml first on
    PYTHONPATH (TorchServe down: the GPU series do not depend on it)."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKE_DIR)] + ([path] if path else [])))
    monkeypatch.setenv("DLRM_FAKE_NVML_DEVICES", "2")
    dead = f"http://127.0.0.1:{dead_port()}"
    sc = start_sidecar(tmp_path, management_url=dead, metrics_url=dead, inference_url=dead,
                       model_name="dlrm", multiproc_dir=tmp_path / "prom",
                       model_store=tmp_path / "store")
    try:
        r = httpx.get(f"{sc.url}/metrics", timeout=30)
        assert r.status_code == 200
        assert 'dlrm_gpu_utilization_ratio{device="0"} 0.37' in r.text
        assert gpu_samples(samples(r.text)) == {**expected(0), **expected(1)}
    finally:
        sc.stop()


def _registry(collector: GpuCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
