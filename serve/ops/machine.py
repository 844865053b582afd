"""Where a measurement ran: the machine block every benchmark writes beside its figures.

A figure is only comparable with another from the same kind of machine. The 2-core
machines this project is measured on are not always the same CPU: one session's was a
Xeon with AMX (bf16 GEMMs at ~2.2 TFLOP/s on 2 threads), the next an AMD EPYC with
AVX-512 BF16 but no AMX (~0.4 TFLOP/s), so a bf16 dense part measured on one says little
about the other. Each benchmark therefore records :func:`machine_info` in its result
(``"machine"``), prints :func:`describe` with its figures, and the dated pages
(:mod:`serve.ops.benchdoc`) show it.

``cpu_flags``: the instruction-set extensions that move this project's figures, read from
``/proc/cpuinfo`` (Linux; elsewhere the list is empty): ``avx2``, ``avx512f``,
``avx512_vnni`` / ``avx_vnni`` (int8 dot products), ``avx512_bf16`` (bf16 dot products)
and ``amx_bf16`` / ``amx_int8`` (Intel's tile matrix units, what makes bf16 and int8
GEMMs several times faster where they exist).

    >>> describe({"cpu_model": "AMD EPYC", "logical_cores": 2, "usable_cores": 2,
    ...           "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "torch": "2.13.0+cpu",
    ...           "gpu": None})
    'AMD EPYC, 2 cores (2 usable), avx2 avx512f avx512_bf16, no AMX, torch 2.13.0+cpu'
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

__all__ = ["ISA_FLAGS", "announce", "cpu_flags", "cpu_model", "describe", "machine_info"]

_log = logging.getLogger(__name__)

#: The CPU flags recorded, in this order (the ones that change GEMM and gather speed).
ISA_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                              "amx_bf16", "amx_int8")
_CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(text: str, name: str) -> str | None:
    """The first ``name : value`` of a /proc/cpuinfo text (the first CPU's), else None."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def _read(cpuinfo: Path) -> str:
    try:
        return cpuinfo.read_text()
    except OSError as e:  # not Linux, or no /proc: the fields stay unknown
        _log.debug("no %s: %s", cpuinfo, e)
        return ""


def _model_in(text: str) -> str:
    return _cpuinfo_field(text, "model name") or platform.processor() or platform.machine()


def _flags_in(text: str) -> list[str]:
    have = set((_cpuinfo_field(text, "flags") or "").split())
    return [f for f in ISA_FLAGS if f in have]


def cpu_model(cpuinfo: Path = _CPUINFO) -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``); else what
    :func:`platform.processor` or :func:`platform.machine` says."""
    return _model_in(_read(cpuinfo))


def cpu_flags(cpuinfo: Path = _CPUINFO) -> list[str]:
    """Which of :data:`ISA_FLAGS` the CPU has (in that order); [] where unknown."""
    return _flags_in(_read(cpuinfo))


def machine_info(cpuinfo: Path = _CPUINFO) -> dict[str, Any]:
    """Where the measurement ran: CPU model and flags, cores, memory, accelerator and the
    versions of torch and TorchServe (each None where it cannot be read)."""
    text = _read(cpuinfo)
    info: dict[str, Any] = {
        "cpu_model": _model_in(text),
        "cpu_flags": _flags_in(text),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "memory_bytes": None,
        "torch": None,
        "gpu": None,
        "torchserve": None,
    }
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["torchserve"] = version("torchserve")
    except Exception as e:  # noqa: BLE001 - optional detail, never fatal
        _log.debug("no torchserve version: %s", e)
    return info


def describe(info: Mapping[str, Any]) -> str:
    """One line for a benchmark's output: model, cores, flags, AMX or not, torch, GPU."""
    flags = list(info.get("cpu_flags") or [])
    amx = any(f.startswith("amx") for f in flags)
    parts = [(f"{info.get('cpu_model') or 'unknown CPU'}, {info.get('logical_cores')} cores "
              f"({info.get('usable_cores')} usable)"),
             " ".join(f for f in flags if not f.startswith("amx")) or "no AVX flags read",
             "AMX" if amx else "no AMX"]
    if info.get("torch"):
        parts.append(f"torch {info['torch']}")
    if info.get("gpu"):
        parts.append(f"GPU {info['gpu']}")
    return ", ".join(parts)


def announce(stream: TextIO | None = None) -> dict[str, Any]:
    """:func:`machine_info`, its :func:`describe` line printed first (``machine: ...``,
    on ``stream``, default stdout): what a benchmark calls once, before it measures, to
    write the block into its result."""
    info = machine_info()
    print(f"machine: {describe(info)}", file=stream or sys.stdout, flush=True)
    return info
