"""What this CPU can do, detected at run time (never assumed): vector ISA and native bf16.

Benchmarks record `cpu_summary()` beside every number, and the engine picks kernels by it.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# Flags that decide which kernels are fast. avx512_bf16 / amx_bf16 mean bf16 dot products in
# hardware; without them torch emulates bf16 GEMMs and they are several times slower.
_INTERESTING = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                "amx_int8")
# Set to keep prompt-sized GEMMs of the quantized formats off the AMX tiles (see amx_gemm).
DISABLE_AMX_ENV = "PDSERVE_DISABLE_AMX"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    torch_capability: str  # what ATen dispatches to: "AVX2", "AVX512", ...

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def amx_bf16(self) -> bool:
        """AMX tiles with bf16 dot products (and the AVX-512 bf16 conversions beside them)."""
        return {"amx_tile", "amx_bf16", "avx512_bf16"} <= self.flags

    @property
    def vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & self.flags)

    def summary(self) -> str:
        shown = " ".join(f for f in _INTERESTING if f in self.flags) or "none of " + " ".join(
            _INTERESTING)
        return f"{self.model} | ATen {self.torch_capability} | flags: {shown}"


@functools.cache
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    if not flags and torch.cpu._is_avx512_bf16_supported():  # no /proc (macOS): ask torch
        flags = frozenset({"avx512_bf16"})
    return CpuInfo(model=model, flags=flags,
                   torch_capability=torch.backends.cpu.get_cpu_capability())


def cpu_summary() -> str:
    return cpu_info().summary()


def amx_gemm(info: CpuInfo | None = None) -> bool:
    """Whether the quantized formats (int8, q4_0, q4_1, q8_0) multiply prompt-sized batches as
    bf16 GEMMs on the AMX tiles: the CPU has them, torch's oneDNN takes bf16 (oneDNN is what
    puts a bf16 GEMM on the tiles), and `PDSERVE_DISABLE_AMX` is not set."""
    info = info or cpu_info()
    return (info.amx_bf16 and not os.environ.get(DISABLE_AMX_ENV)
            and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
