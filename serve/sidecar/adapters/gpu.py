"""GPU utilization and memory through NVML, as Prometheus gauges of the sidecar.

Per GPU, labelled ``{device}`` only (NVML's device index as a string, ``"0"``, ``"1"``...):

* ``dlrm_gpu_utilization_ratio``: the fraction of the last sample period (1/6 s to 1 s,
  depending on the product) during which a kernel ran on the GPU, 0..1 (NVML's
  ``utilization.gpu`` percent / 100). It says the GPU was busy, not how much of it.
* ``dlrm_gpu_memory_used_bytes`` / ``dlrm_gpu_memory_total_bytes``: device memory in
  bytes, as NVML reports it (all processes on the GPU, not only TorchServe's workers;
  ``total`` is what the driver makes available, a little under the card's size).

The values are read at scrape time, so they are as fresh as the scrape. NVML's index is
the PCI bus order: it equals the CUDA device index only with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (PyTorch's default order is "fastest first"), and NVML
ignores ``CUDA_VISIBLE_DEVICES``: it lists every GPU the container can open.

On a machine without an NVIDIA GPU or driver (or without the ``nvidia-ml-py`` package)
the collector is disabled: it logs one info line saying why and exports nothing, so a
CPU pod's /metrics simply has no ``dlrm_gpu_`` series. Do not use it for per-process GPU
memory: NVML's per-device figures include every process on the device.

Example::

    gpu = GpuCollector()                 # the real pynvml; disabled without a GPU
    registry.register(gpu)
    ...
    gpu.close()                          # nvmlShutdown, at shutdown

Tests inject a fake ``pynvml`` module (``tests/fixtures/fake_nvml/pynvml.py``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serve.metrics import GPU_MEMORY_TOTAL_BYTES, GPU_MEMORY_USED_BYTES, GPU_UTILIZATION_RATIO

__all__ = ["ERROR_LOG_INTERVAL_S", "GpuCollector", "load_pynvml"]

_log = logging.getLogger(__name__)

#: Failed NVML reads during scrapes are logged at most this often (seconds): a GPU that
#: fails every read would otherwise log on every scrape (every 15 s per Prometheus).
ERROR_LOG_INTERVAL_S = 60.0


def load_pynvml() -> ModuleType:
    """The real NVML bindings (``import pynvml``, from the ``nvidia-ml-py`` package).

    Imported here, lazily, so that importing this module never needs the package.
    """
    import pynvml

    return pynvml


class GpuCollector(Collector):
    """Exports the GPUs' utilization and memory (see the module docstring for units).

    Args:
        nvml: the NVML bindings, a module with pynvml's functions and ``NVMLError``;
            None: :func:`load_pynvml` (an ImportError disables the collector).
        clock: monotonic seconds, to rate-limit the log of failed reads.

    The constructor calls ``nvmlInit`` and ``nvmlDeviceGetCount``. If that fails (no
    driver, library not found) or finds no GPU, the collector is disabled
    (:attr:`enabled` False, :attr:`reason` says why) and :meth:`collect` yields nothing.
    A read that fails during a scrape (a GPU fallen off the bus, a value the device does
    not support, e.g. utilization under MIG) drops that value only; the scrape goes on,
    never raises, and the failures are logged at most once per
    :data:`ERROR_LOG_INTERVAL_S` and counted in :attr:`read_errors`.
    """

    def __init__(self, nvml: ModuleType | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._nvml: ModuleType | None = None
        self.device_count = 0
        #: Why the collector is disabled; None while it is enabled.
        self.reason: str | None = None
        #: NVML reads that failed during scrapes, since construction.
        self.read_errors = 0
        self._unlogged = 0  # failed reads since the last log line
        self._last_error = ""
        self._last_log: float | None = None
        self._start(nvml)

    def _start(self, nvml: ModuleType | None) -> None:
        if nvml is None:
            try:
                nvml = load_pynvml()
            except ImportError as e:
                self._disable(f"cannot import pynvml: {e}; install nvidia-ml-py")
                return
        try:
            nvml.nvmlInit()
        except (nvml.NVMLError, OSError) as e:
            self._disable(f"nvmlInit failed: {_describe(e)}")
            return
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except (nvml.NVMLError, OSError) as e:
            _shutdown(nvml)
            self._disable(f"nvmlDeviceGetCount failed: {_describe(e)}")
            return
        if count < 1:
            _shutdown(nvml)
            self._disable("NVML found 0 devices")
            return
        self._nvml, self.device_count = nvml, count
        _log.info("GPU metrics: exporting %d NVIDIA GPU(s) through NVML", count)

    def _disable(self, reason: str) -> None:
        self.reason = reason
        _log.info("no NVIDIA GPU/driver: GPU metrics not exported (%s)", reason)

    @property
    def enabled(self) -> bool:
        """NVML is initialized and found at least one GPU."""
        return self._nvml is not None

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not call :meth:`collect` (NVML)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The three gauge families, one sample per device that answered; nothing when
        disabled."""
        nvml = self._nvml
        if nvml is None:
            return
        util = GaugeMetricFamily(
            GPU_UTILIZATION_RATIO,
            "Fraction of the last NVML sample period in which a kernel ran on the GPU "
            "(0-1).", labels=["device"])
        used = GaugeMetricFamily(
            GPU_MEMORY_USED_BYTES, "GPU memory used by all processes on the device, in bytes.",
            labels=["device"])
        total = GaugeMetricFamily(
            GPU_MEMORY_TOTAL_BYTES, "GPU memory available on the device, in bytes.",
            labels=["device"])
        for index in range(self.device_count):
            device = str(index)
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as e:  # noqa: BLE001 - a scrape must never fail for the GPU
                self._failed(device, "nvmlDeviceGetHandleByIndex", e)
                continue
            # Each value on its own: under MIG, utilization is NOT_SUPPORTED but memory is.
            try:
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                util.add_metric([device], float(rates.gpu) / 100.0)
            except Exception as e:  # noqa: BLE001
                self._failed(device, "nvmlDeviceGetUtilizationRates", e)
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric([device], float(memory.used))
                total.add_metric([device], float(memory.total))
            except Exception as e:  # noqa: BLE001
                self._failed(device, "nvmlDeviceGetMemoryInfo", e)
        yield util
        yield used
        yield total

    def _failed(self, device: str, call: str, error: Exception) -> None:
        with self._lock:
            self.read_errors += 1
            self._unlogged += 1
            self._last_error = f"device {device} {call}: {_describe(error)}"
            now = self._clock()
            if self._last_log is not None and now - self._last_log < ERROR_LOG_INTERVAL_S:
                return
            n, self._unlogged, self._last_log = self._unlogged, 0, now
            last = self._last_error
        _log.warning("GPU metrics: %d NVML read(s) failed (values left out of the scrape); "
                     "last: %s", n, last)

    def close(self) -> None:
        """``nvmlShutdown`` if enabled; afterwards the collector exports nothing.
        Calling it again is harmless."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            self.reason = "closed"
            _shutdown(nvml)


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - pynvml's __str__ calls into NVML itself
        text = repr(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _shutdown(nvml: ModuleType) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - shutting down must not fail the caller
        _log.debug("nvmlShutdown failed: %s", _describe(e))
