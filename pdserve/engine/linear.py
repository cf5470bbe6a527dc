"""The model's matrix multiplies, as kernels over weights prepared once at load time.

A decode step streams every weight once; on a CPU that makes the linear layers most of a step,
so their weight format and kernel decide the speed. Each `LinearKernel` owns its weights in the
layout its kernel wants (fused projections are packed as one matrix) and computes
``x @ W.T + b`` for activations ``x`` of shape ``[tokens, in_features]`` in the activation dtype.

Formats (`pack_linear`, picked by `EngineConfig.dtype`):

- ``float32``: on CPU, the weights repacked once into panels of 32 (AVX-512; 16 on AVX2)
  output rows for the extension's GEMM (kernels/cpu_ops.cpp `panel_linear`): exact fp32
  arithmetic that streams the weights at memory speed at decode's batches (1.9-2.7x oneDNN's
  prepacked GEMM at 1-16 rows, 1.1x at 512, on a Zen 4: bench.linear_kernels, record in
  docs/BENCHMARKS.md). Without the extension, oneDNN's prepacked (blocked) fp32 GEMM;
  `F.linear` elsewhere.
- ``bfloat16`` / ``float16``: the weights and activations in that dtype (`F.linear`, oneDNN on
  CPU). Only sensible where the CPU has native bf16 (see engine.cpu).
- ``int8``: per-output-channel symmetric int8 weights (a quarter of float32's bytes) through
  fbgemm's int8 GEMM. torch's weight-only int8 kernel (``_weight_int8pack_mm``) measured ~10x
  slower than float32 on AVX2, and fbgemm quantizes activations too, to 7 bits on CPUs without
  VNNI, which alone cost 20 % of greedy top-1 agreement with float32. So each activation row
  goes in twice: scaled to its max-abs, and its rounding residual scaled the same way; the
  two results add up to ~14-bit activations, as accurate as weight-only int8 (measured: see
  bench/quality.py) for one extra row per token. fbgemm picks one activation range per call;
  a fixed [-1, 1] row pins it, so a token's result never depends on its batchmates.
  Prefill-sized batches (more than `Int8DynamicLinear.SMALL_M` rows) skip all that: they go
  through the fp32 panel GEMM over int8 panels, each panel dequantized once per call as the
  GEMM reaches it (cpu_ops.cpp `panel_linear_i8`: exact weight-only int8 arithmetic; into
  the thread's L1/L2 buffer, or, on the cache-blocked path of long prompts, into a buffer of
  the thread's share of panels that it keeps between calls), so int8 prefill runs within a
  few percent of float32's speed. On a CPU with AMX (engine.cpu.amx_gemm) batches from
  `Int8DynamicLinear.AMX_ROWS` rows instead take the int8 panels as bf16 (exact) through
  oneDNN's GEMM on the tiles, with x and the output rounded to bf16 (`panel_linear_i8_bf16`).
  Without the extension the int8 weights are expanded to float32 per call for `F.linear`.
- ``q4_0`` / ``q4_1`` / ``q8_0``: GGUF's own 32-weight blocks (4.5-8.5 bits per weight), kept as
  blocks and multiplied by the extension in kernels/quant_ops.cpp (the path picked from the
  detected CPU flags). A weight carrying blocks read from the model's GGUF
  (`attach_gguf_blocks`) is used as stored when they are of the requested type or Q8_0; any
  other weight is quantized at load with gguf-py's quantizer. On a CPU with AVX2 or AVX-512
  VNNI the blocks are also repacked at load into 16-row panels and every batch, prefill
  included, runs with activations rounded to int8 per block of 32 (llama.cpp's arithmetic,
  2-3x the float kernels' speed; agreement in docs/BENCHMARKS.md). Without AVX2, or with
  ``PDSERVE_QUANT_ISA=avx512`` (``avx2``), activations stay float32 (the weights exactly as
  dequantized) and large batches (prefill) are expanded to float32 for the fp32 GEMM. On a
  CPU with AMX (path ``avx512vnni_amx``) prompt-sized batches are expanded to bf16 per call
  and multiplied on the tiles instead (quant_ops.cpp `panels_to_bf16`).

``PDSERVE_DISABLE_AMX=1`` keeps every format off the AMX tiles.
"""

from __future__ import annotations

import abc
import warnings
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.engine.cpu import amx_gemm

QUANT_FORMATS = ("q4_0", "q4_1", "q8_0")
WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", *QUANT_FORMATS)
# fbgemm's dynamic activation grid with reduce_range (7 bits; safe from the AVX2 u8*s8 pair
# saturation) over the pinned range [-1, 1]: scale 2/127, zero point 64, so a value v is
# represented as round(v * 63.5) / 63.5 within [-64/63.5, 63/63.5]. Rows are scaled to
# +-_SHRINK so their maxima are never clipped.
_STEPS = 63.5
_SHRINK = 0.99
_FLOAT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (weights, out_features, bias, kernel, qtype, isa); the kernel is None for the fp32 panels, a
# capsule for the quantized panels, or (packed, scales, anchor, steps, shrink, small_m,
# amx_rows) for int8
StepSpec = tuple[torch.Tensor, int, torch.Tensor | None, object, int, int]


class LinearKernel(abc.ABC):
    """``y = x @ W.T + b``. Stateless after construction, so safe to call from any thread."""

    in_features: int
    out_features: int

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of weights one call reads (what bounds a decode step)."""

    def step_spec(self) -> StepSpec | None:
        """How the C++ layer loop (cpu_ops.cpp's DecodeStack) calls this kernel, at every
        batch size (decode steps and prompt chunks), or None where it cannot (the Python loop
        runs instead)."""
        return None


class DenseLinear(LinearKernel):
    """`F.linear` on a plain weight: any device, any float dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class OneDnnLinear(LinearKernel):
    """oneDNN GEMM on a weight reordered once into its blocked layout (what inductor's
    freezing does for CPU linears). Same fp32 arithmetic as `F.linear`, other summation order."""

    # oneDNN picks the blocked layout by an expected batch; 1 measured best for decode steps
    # and no worse than `F.linear` for prefill chunks.
    BATCH_HINT = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features, self.in_features = weight.shape
        self._nbytes = weight.numel() * weight.element_size()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self._nbytes


class PanelLinear(LinearKernel):
    """The extension's fp32 GEMM over the weight repacked into panels of output rows
    (cpu_ops.cpp `pack_panels` / `panel_linear`): one copy of the weights, read once per call
    at every batch size. Same fp32 arithmetic as `F.linear` (fused multiply-adds, each
    output's sum over k in order)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ext: ModuleType):
        self.out_features, self.in_features = weight.shape
        self._nbytes = weight.numel() * weight.element_size()
        self._ext = ext
        self.panels = ext.pack_panels(weight)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        lead = x.shape[:-1]
        y = self._ext.panel_linear(x.reshape(-1, self.in_features), self.panels,
                                   self.out_features, self.bias)
        return y.view(*lead, self.out_features)

    def step_spec(self) -> StepSpec:
        return (self.panels, self.out_features, self.bias, None, 0, 0)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class Int8DynamicLinear(LinearKernel):
    """fbgemm int8 x int8 GEMM: per-channel int8 weights, per-token int8 activations."""

    # Batches larger than this (prefill chunks, big decode batches) take the fp32 panel GEMM
    # over int8 panels: compute-bound there, where fbgemm's two rows per token cost more.
    SMALL_M = 32
    # On a CPU with AMX (engine.cpu.amx_gemm), batches from this many rows take the int8 panels
    # as bf16 through oneDNN's GEMM on the tiles instead (cpu_ops.cpp panel_linear_i8_bf16).
    # Where the two crossed on a Sapphire Rapids: a whole prompt's prefill 0.89x at 64 tokens
    # with 64 as the threshold; 1.51x at 128, 2.24x at 512 (prefill_amx_52ccd54_spr.json).
    AMX_ROWS = 96

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        weight = weight.float()
        self.out_features, self.in_features = weight.shape
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated: see README
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(
                weight, scales, torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.float()
        # The fixed row: its min and max pin fbgemm's per-call activation range to [-1, 1].
        self._anchor = torch.zeros(1, self.in_features)
        self._anchor[0, 0], self._anchor[0, -1] = -1.0, 1.0
        self._nbytes = self.out_features * self.in_features
        self._scales = scales.float()
        from pdserve.engine.kernels import cpu_extension

        self._ext = cpu_extension()  # the row split and merge as two fused loops, if built
        # For prefill-sized batches: the same int8 weights as panels for `panel_linear_i8`, or
        # without the extension as they are, expanded to float32 per call.
        self._qweight = qweight.int_repr()
        self._amx_rows = 0
        if self._ext is not None:
            self._qweight = self._ext.pack_panels(self._qweight)
            self._amx_rows = self.AMX_ROWS if amx_gemm() else 0

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in] this kernel computes with (for tests and benches)."""
        q = self._qweight
        if q.dim() == 3:  # panels [np, in, PW] -> rows
            q = q.permute(0, 2, 1).reshape(-1, self.in_features)[:self.out_features]
        return q.float().mul_(self._scales[:, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.SMALL_M:
            if self._ext is not None and x.dtype == torch.float32 and x.dim() == 2:
                big = self._amx_rows and x.shape[0] >= self._amx_rows
                gemm = self._ext.panel_linear_i8_bf16 if big else self._ext.panel_linear_i8
                return gemm(x.contiguous(), self._qweight, self._scales, self.out_features,
                            self.bias)
            return F.linear(x, self.dequantize(), self.bias)
        if self._ext is not None and x.dtype == torch.float32 and x.stride(-1) == 1:
            rows, amax, lo_amax = self._ext.int8_rows(x, self._anchor, _STEPS, _SHRINK)
            y = torch.ops.quantized.linear_dynamic(rows, self.packed, True)
            return self._ext.int8_merge(y, amax, lo_amax, _SHRINK, self.bias)
        m = x.shape[0]
        amax = x.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
        hi = x * (_SHRINK / amax)
        # What fbgemm's 7-bit grid loses of each row, as a second row on its own grid: the
        # two rows together carry ~14 bits per activation through the same int8 GEMM.
        lo = hi - torch.round(hi * _STEPS) / _STEPS
        lo_amax = lo.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
        lo.mul_(_SHRINK / lo_amax)
        y = torch.ops.quantized.linear_dynamic(torch.cat((hi, lo, self._anchor)), self.packed,
                                               True)
        out = torch.addcmul(y[:m], y[m:2 * m], lo_amax).mul_(amax / _SHRINK)
        return out if self.bias is None else out.add_(self.bias)

    def step_spec(self) -> StepSpec | None:
        # cpu_ops.cpp's Int8Linear makes `__call__`'s calls; without the extension there is
        # no C++ loop either.
        if self._ext is None:
            return None
        return (self._qweight, self.out_features, self.bias,
                (self.packed, self._scales, self._anchor, _STEPS, _SHRINK, self.SMALL_M,
                 self._amx_rows), 0, 0)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class QuantLinear(LinearKernel):
    """GGUF block-quantized weights (see engine.kernels.quant) through the compiled kernels;
    float32 activations in and out. Without the extension, the weights are expanded to
    float32 once (correct, no faster than float32)."""

    # Batches larger than this expand the blocks to float32 and use the fp32 GEMM (prefill).
    SMALL_M = 16

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None):
        from pdserve.engine.kernels import quant

        self.qtype, self.in_features = qtype, in_features
        self._blocks: torch.Tensor | None = blocks.contiguous()
        self.out_features = blocks.shape[0]
        self.bias = None if bias is None else bias.float().contiguous()
        self._nbytes = blocks.numel()
        self._code = quant.QTYPES[qtype]
        isa = quant.default_isa()
        self._isa = quant.ISAS[isa]
        self._ext = quant.quant_extension()
        self._dense: torch.Tensor | None = None
        self._panels: torch.Tensor | None = None
        if self._ext is None:
            self._dense = quant.dequantize_reference(blocks, qtype, in_features)
        elif isa in quant.INT8_ACTIVATION_ISAS:  # int8 activations, 16-row panels, any batch
            self._panels = self._ext.repack_panels(self._blocks, self._code, in_features)
            self._nbytes = self._panels.numel()
            self._blocks = None  # the panels hold the same bytes: keep one copy

    @property
    def blocks(self) -> torch.Tensor:
        """The GGUF blocks [out_features, bytes] (rebuilt from the panels where those are kept)."""
        if self._blocks is not None:
            return self._blocks
        assert self._ext is not None and self._panels is not None
        return self._ext.panels_to_blocks(self._panels, self._code, self.out_features,
                                          self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 [out, in] (bitwise gguf-py's dequantization)."""
        if self._dense is not None:
            return self._dense
        assert self._ext is not None
        return self._ext.dequantize(self.blocks, self._code, self.in_features, self._isa)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            assert self._ext is not None
            return self._ext.quant_linear_panels(x, self._panels, self._code, self.out_features,
                                                 self._isa, self.bias)
        if self._dense is not None or x.shape[0] > self.SMALL_M:
            return F.linear(x, self.dequantize(), self.bias)
        assert self._ext is not None
        return self._ext.quant_linear(x, self.blocks, self._code, self._isa, self.bias)

    def step_spec(self) -> StepSpec | None:
        # Only the panels run every batch size with one kernel; the blocks' path switches to
        # a float GEMM past SMALL_M.
        if self._panels is None or self._ext is None:
            return None
        return (self._panels, self.out_features, self.bias, self._ext.linear_panels_capsule(),
                self._code, self._isa)

    @property
    def nbytes(self) -> int:
        return self._nbytes


_GGUF_ATTR = "_pdserve_gguf_blocks"


def attach_gguf_blocks(weight: torch.Tensor, qtype: str, blocks: torch.Tensor) -> None:
    """Mark a (float) weight with the GGUF blocks it was dequantized from, so `pack_linear`
    for a quantized format uses the stored blocks instead of quantizing again."""
    setattr(weight, _GGUF_ATTR, (qtype, blocks))


def detach_gguf_blocks(weight: torch.Tensor) -> None:
    """Drop what `attach_gguf_blocks` marked (once the kernels are packed they hold their own;
    a weight kept in float, such as an embedding tied to the head, would keep them alive)."""
    if hasattr(weight, _GGUF_ATTR):
        delattr(weight, _GGUF_ATTR)


def _quant_blocks(weight: torch.Tensor, weight_format: str) -> tuple[str, torch.Tensor]:
    from pdserve.engine.kernels import quant

    stored = getattr(weight, _GGUF_ATTR, None)
    if stored is not None and stored[0] in (weight_format, "q8_0"):
        return stored[0], stored[1]
    return weight_format, quant.quantize_reference(weight, weight_format)


def _pack_quant(weights: list[torch.Tensor], bias: torch.Tensor | None,
                weight_format: str) -> LinearKernel:
    if weights[0].device.type != "cpu":
        raise ValueError(f"{weight_format} weights are a CPU format; use float16/bfloat16 on "
                         f"{weights[0].device.type}")
    parts = [_quant_blocks(w, weight_format) for w in weights]
    qtypes = {q for q, _ in parts}
    if len(qtypes) > 1:  # fused projections stored in different types: requantize them all
        from pdserve.engine.kernels import quant

        parts = [(weight_format, quant.quantize_reference(w, weight_format)) for w in weights]
    qtype = parts[0][0]
    blocks = parts[0][1] if len(parts) == 1 else torch.cat([b for _, b in parts])
    return QuantLinear(blocks, qtype, weights[0].shape[1], bias)


def _onednn_ok(dtype: torch.dtype) -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and dtype in (torch.float32, torch.bfloat16))


def pack_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None], *,
                weight_format: str) -> LinearKernel:
    """One kernel computing the given projections side by side (outputs concatenated in
    order), e.g. q/k/v or gate/up, so a layer issues one GEMM where it had several."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; one of {WEIGHT_FORMATS}")
    bias: torch.Tensor | None = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                          for w, b in zip(weights, biases, strict=True)]).detach()
    if weight_format in QUANT_FORMATS:
        return _pack_quant(weights, bias, weight_format)
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if weight_format == "int8":
        if weight.device.type != "cpu":
            raise ValueError("int8 weights are a CPU format (fbgemm); use float16/bfloat16 on "
                             f"{weight.device.type}")
        return Int8DynamicLinear(weight, bias)
    dtype = _FLOAT[weight_format]
    weight = weight.to(dtype).contiguous()
    bias = None if bias is None else bias.to(dtype)
    if weight.device.type == "cpu" and dtype == torch.float32:
        from pdserve.engine.kernels import cpu_extension

        ext = cpu_extension()
        if ext is not None:
            return PanelLinear(weight, bias, ext)
    if weight.device.type == "cpu" and _onednn_ok(dtype):
        try:
            return OneDnnLinear(weight, bias)
        except RuntimeError:  # oneDNN lacks this dtype on this CPU (e.g. bf16 without AVX-512)
            pass
    return DenseLinear(weight, bias)
