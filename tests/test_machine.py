"""serve.ops.machine: the machine block every benchmark writes beside its figures, read
from a fake /proc/cpuinfo (the real one differs from machine to machine)."""
from __future__ import annotations

from pathlib import Path

from serve.ops.machine import ISA_FLAGS, cpu_flags, cpu_model, describe, machine_info

_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: something else entirely
flags\t\t: fpu
"""
_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16
"""


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_machine_reads_the_first_cpus_model_and_the_flags_that_move_gemms(tmp_path: Path):
    xeon = _cpuinfo(tmp_path, _XEON)
    assert cpu_model(xeon) == "Intel(R) Xeon(R) Platinum 8480+"
    # amx_tile is not one of the recorded flags; the order is ISA_FLAGS', not the file's.
    assert cpu_flags(xeon) == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                               "amx_int8"]
    info = machine_info(xeon)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["logical_cores"] >= 1 and info["torch"]
    assert set(info) >= {"cpu_flags", "usable_cores", "memory_bytes", "gpu", "torchserve"}
    assert describe(info).startswith("Intel(R) Xeon(R) Platinum 8480+, ")
    assert ", avx2 avx512f avx512_vnni avx512_bf16, AMX, torch " in describe(info)


def test_machine_says_no_amx_where_the_cpu_has_none(tmp_path: Path):
    info = machine_info(_cpuinfo(tmp_path, _EPYC))
    assert info["cpu_flags"] == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]
    line = describe(info)
    assert line.startswith("AMD EPYC, ") and ", no AMX" in line and "amx" not in line


def test_machine_without_cpuinfo_still_describes_itself(tmp_path: Path):
    missing = tmp_path / "absent"
    assert cpu_flags(missing) == []
    assert cpu_model(missing)            # platform's answer instead
    assert "no AVX flags read, no AMX" in describe(machine_info(missing))
    assert set(ISA_FLAGS) >= {"avx512_bf16", "amx_bf16"}
