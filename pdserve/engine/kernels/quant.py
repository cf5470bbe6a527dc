"""GGUF block-quantized weights: the torch reference and the compiled kernels (quant_ops.cpp).

Weights stay in the GGUF's own blocks of 32 (``Q4_0``: fp16 d + 16 bytes of nibbles, w = d*(q-8);
``Q4_1``: fp16 d, fp16 m + nibbles, w = d*q + m; ``Q8_0``: fp16 d + 32 int8, w = d*q), one row
of blocks per output feature, as a uint8 tensor ``[out_features, in_features / 32 * bytes]``.
`dequantize_reference` is gguf-py's arithmetic in torch; the extension's ``dequantize`` gives
bitwise the same floats and ``quant_linear`` multiplies without materializing them.

The extension is built apart from cpu_ops.cpp (own source, cache key and flock), without
-march=native: each vector path carries its own target attribute and `isa_for()` picks one
from the CPU's detected flags (engine.cpu), so one build never assumes an ISA.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType

import structlog
import torch

from pdserve.engine.cpu import CpuInfo, amx_gemm, cpu_info
from pdserve.engine.kernels import BUILD_WAIT_S, _build_root, _exclusive

log = structlog.get_logger(__name__)
_SOURCE = Path(__file__).with_name("quant_ops.cpp")
DISABLE_ENV = "PDSERVE_DISABLE_QUANT_KERNELS"
# Pin a narrower path than the CPU's widest, e.g. "avx512" for float32 activations on a VNNI CPU.
ISA_ENV = "PDSERVE_QUANT_ISA"
BLOCK = 32
# Our codes (the C++ enum), the GGML type ids (gguf.GGMLQuantizationType) and bytes per block.
QTYPES = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
GGML_IDS = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
# Narrowest first. avx2_int8 and avx512vnni round activations to int8 (panels); the rest keep
# them float32. avx512vnni_amx is avx512vnni for decode-sized batches and, from `amx_rows()`
# rows on (prompt chunks), bf16 weights and activations through oneDNN's GEMM on the AMX tiles.
ISAS = {"generic": 0, "avx2": 1, "avx2_int8": 4, "avx512": 2, "avx512vnni": 3,
        "avx512vnni_amx": 5}
# Each panel path and the float-activation path of the same ISA.
FLOAT_PATH_OF = {"avx2_int8": "avx2", "avx512vnni": "avx512", "avx512vnni_amx": "avx512"}
INT8_ACTIVATION_ISAS = tuple(FLOAT_PATH_OF)


def isa_for(info: CpuInfo) -> str:
    """The widest vector path this CPU has (by its flags, never assumed). ``avx512vnni`` and
    ``avx2_int8`` round activations to int8 per block of 32 (llama.cpp's arithmetic; see
    quant_ops.cpp); the others multiply float32 activations by the exactly dequantized
    weights."""
    if {"avx512f", "avx512bw", "avx2", "fma", "f16c"} <= info.flags:
        if not {"avx512vl", "avx512_vnni"} <= info.flags:
            return "avx512"
        return "avx512vnni_amx" if amx_gemm(info) else "avx512vnni"
    if {"avx2", "fma", "f16c"} <= info.flags:
        return "avx2_int8"
    return "generic"


def amx_rows() -> int | None:
    """Rows from which ``avx512vnni_amx`` multiplies on the AMX tiles (None: no extension)."""
    ext = quant_extension()
    return None if ext is None or not hasattr(ext, "amx_rows") else int(ext.amx_rows())


def available_isas(info: CpuInfo) -> list[str]:
    """Every path this CPU can run, narrowest first (tests run them all)."""
    order = list(ISAS)
    return order[: order.index(isa_for(info)) + 1]


def _halves(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def dequantize_reference(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """[out, in] float32, gguf-py's dequantize in torch (d * q, then + m; no FMA)."""
    rows = blocks.shape[0]
    nb = in_features // BLOCK
    b = blocks.view(rows, nb, BLOCK_BYTES[qtype])
    d = _halves(b[..., 0:2])  # [rows, nb, 1]
    if qtype == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, in_features)
    qs = b[..., 4:] if qtype == "q4_1" else b[..., 2:]
    q = torch.cat((qs & 15, qs >> 4), dim=-1)
    if qtype == "q4_1":
        return (d * q.float() + _halves(b[..., 2:4])).reshape(rows, in_features)
    return (d * (q.to(torch.int8) - 8).float()).reshape(rows, in_features)


def quantize_activations_reference(
        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] float32 -> (qx int8 [m, nb, 32], dx [m, nb], sx [m, nb]): each block of 32
    scaled to its max-abs (dx = max|x| / 127, qx = round(x / dx), ties to even) and
    sx = dx * sum(qx): the int8-activation paths' activations (llama.cpp's Q8_1), bit for bit."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    dx = xb.abs().amax(-1) / 127
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    qx = torch.round(xb * inv[..., None]).clamp(-128, 127).to(torch.int8)
    return qx, dx, dx * qx.sum(-1, dtype=torch.int32).float()


def quant_linear_int8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str,
                                in_features: int) -> torch.Tensor:
    """[m, out] float64: x @ W.T with x quantized as `quantize_activations_reference` does and
    the per-block products exact (what the panel kernels compute, up to float32 sums)."""
    qx, dx, sx = quantize_activations_reference(x)
    w = dequantize_reference(blocks, qtype, in_features).double()
    rows, nb = blocks.shape[0], in_features // BLOCK
    b = blocks.view(rows, nb, BLOCK_BYTES[qtype])
    d = _halves(b[..., 0:2])[..., 0].double()  # [rows, nb]
    # w = d * u + c per block, so the codes are (w - c) / d; c as the kernel takes it
    c = {"q4_0": -8 * d, "q8_0": torch.zeros_like(d)}.get(qtype)
    if c is None:
        c = _halves(b[..., 2:4])[..., 0].double()
    wq = w.view(rows, nb, BLOCK)
    codes = torch.where(d[..., None] != 0, (wq - c[..., None]) / d[..., None], 0).round()
    dots = torch.einsum("jbk,ibk->ijb", codes, qx.double())  # exact integers
    return (dots * d[None] * dx.double()[:, None]).sum(-1) + sx.double() @ c.T


def quantize_reference(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """Float [out, in] -> blocks, with gguf-py's quantizer (what llama.cpp's convert writes)."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"{qtype} needs in_features divisible by {BLOCK}, got {in_features}")
    data = gguf.quants.quantize(weight.detach().float().cpu().numpy(),
                                GGMLQuantizationType(GGML_IDS[qtype]))
    return torch.from_numpy(data.copy()).view(torch.uint8).reshape(out_features, -1)


@functools.cache
def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()
                         + str(_SOURCE.resolve()).encode() + str(torch.__file__).encode()
                         ).hexdigest()[:16]
    name = f"pdserve_quant_ops_{key}"
    build_dir = _build_root() / name
    log.info("quant_kernels_loading", name=name,
             note="compiled once per machine (under a minute), then cached")
    try:
        with _exclusive(build_dir.with_suffix(".flock"), BUILD_WAIT_S):
            stale = build_dir / "lock"  # a killed build's baton (we hold the only flock)
            if stale.exists():
                stale.unlink(missing_ok=True)
            build_dir.mkdir(parents=True, exist_ok=True)
            return cpp_extension.load(
                name=name, sources=[str(_SOURCE)], build_directory=str(build_dir),
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, unusual platform: stay correct
        log.warning("quant_kernels_unavailable", error=str(exc)[:500],
                    fallback="weights dequantized to float32 at load")
        return None


def quant_extension() -> ModuleType | None:
    """The compiled quantized kernels, or None where they cannot be built (or are disabled)."""
    return None if os.environ.get(DISABLE_ENV) else _build()


def default_isa() -> str:
    """The CPU's widest path, or the one `PDSERVE_QUANT_ISA` names (if this CPU can run it)."""
    asked = os.environ.get(ISA_ENV)
    if not asked:
        return isa_for(cpu_info())
    if asked not in available_isas(cpu_info()):
        raise ValueError(f"{ISA_ENV}={asked}: this CPU runs {available_isas(cpu_info())}")
    return asked
