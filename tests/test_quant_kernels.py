"""GGUF block-quantized kernels (engine/kernels/quant_ops.cpp) against the torch reference.

Every vector path this CPU can run (generic, AVX2, AVX-512: picked from its detected flags) must
dequantize bitwise like gguf-py and multiply within float tolerance of the reference
dequantization's fp32 GEMM; the GGUF's own tensors must be exactly what the float32 checkpoint
was converted from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.cpu import cpu_info
from pdserve.engine.kernels import quant
from pdserve.engine.linear import QuantLinear, attach_gguf_blocks, pack_linear

FORMATS = ("q4_0", "q4_1", "q8_0")
ISAS = quant.available_isas(cpu_info())


@pytest.fixture(scope="module")
def ext():  # type: ignore[no-untyped-def]
    module = quant.quant_extension()
    if module is None:
        pytest.skip("quantized kernels could not be built here")
    return module


@pytest.mark.parametrize("qtype", FORMATS)
def test_reference_dequantize_is_gguf_py(qtype: str) -> None:
    import gguf.quants
    from gguf import GGMLQuantizationType

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    blocks = quant.quantize_reference(w, qtype)
    assert blocks.shape == (40, 96 // 32 * quant.BLOCK_BYTES[qtype])
    theirs = gguf.quants.dequantize(blocks.numpy(), GGMLQuantizationType(quant.GGML_IDS[qtype]))
    assert torch.equal(quant.dequantize_reference(blocks, qtype, 96), torch.from_numpy(theirs))
    assert np.abs(theirs - w.numpy()).max() < (0.02 if qtype == "q8_0" else 0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_kernels_match_reference(ext, qtype: str, isa: str) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    n, k = 67, 320  # odd row count: parallel chunks with remainders
    w = torch.randn(n, k, generator=g)
    blocks = quant.quantize_reference(w, qtype)
    ref = quant.dequantize_reference(blocks, qtype, k)
    code, isa_code = quant.QTYPES[qtype], quant.ISAS[isa]
    assert torch.equal(ext.dequantize(blocks, code, k, isa_code), ref)
    bias = torch.randn(n, generator=g)
    for m in (1, 2, 5, 16):
        x = torch.randn(m, k, generator=g)
        want = torch.nn.functional.linear(x.double(), ref.double(), bias.double())
        got = ext.quant_linear(x, blocks, code, isa_code, bias)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        got = ext.quant_linear(x, blocks, code, isa_code, None)
        torch.testing.assert_close(got.double(), want - bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", [i for i in quant.INT8_ACTIVATION_ISAS if i in ISAS])
@pytest.mark.parametrize("qtype", FORMATS)
def test_panels_match_the_int8_activation_reference(ext, qtype: str, isa: str) -> None:  # type: ignore[no-untyped-def]
    """16-row panels with int8 activations (AVX2 and AVX-512 VNNI): the reference's exact
    per-block integer products, up to float32 sums, at every batch size (odd rows: a partial
    last panel)."""
    g = torch.Generator().manual_seed(4)
    code, isa_code = quant.QTYPES[qtype], quant.ISAS[isa]
    for n, k in ((67, 320), (16, 96), (5, 64)):
        blocks = quant.quantize_reference(torch.randn(n, k, generator=g), qtype)
        panels = ext.repack_panels(blocks, code, k)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 5, 16, 33):
            x = torch.randn(m, k, generator=g) * 3
            want = quant.quant_linear_int8_reference(x, blocks, qtype, k)
            got = ext.quant_linear_panels(x, panels, code, n, isa_code, bias).double()
            got -= bias.double()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(ext.panels_to_blocks(panels, code, n, k), blocks)
        # and the activations' rounding is the whole of the difference from float
        x = torch.randn(8, k, generator=g)
        exact = x.double() @ quant.dequantize_reference(blocks, qtype, k).double().T
        got = ext.quant_linear_panels(x, panels, code, n, isa_code, None).double()
        assert (got - exact).norm() / exact.norm() < 0.02


@pytest.mark.skipif("avx512vnni_amx" not in ISAS, reason="no AMX (amx_bf16) on this CPU")
@pytest.mark.parametrize("qtype", FORMATS)
def test_amx_path_is_a_bf16_gemm_over_the_exact_weights(ext, qtype: str) -> None:  # type: ignore[no-untyped-def]
    """avx512vnni_amx: decode-sized batches as avx512vnni, from amx_rows() rows the weights
    expanded exactly and rounded to bf16, times x rounded to bf16 (oneDNN's GEMM: float32
    sums, the output rounded to bf16): within a bf16 rounding of the product in double."""
    g = torch.Generator().manual_seed(5)
    code, amx, vnni = quant.QTYPES[qtype], quant.ISAS["avx512vnni_amx"], quant.ISAS["avx512vnni"]
    rows = ext.amx_rows()
    for n, k in ((67, 320), (16, 96), (5, 64)):
        blocks = quant.quantize_reference(torch.randn(n, k, generator=g), qtype)
        ref = quant.dequantize_reference(blocks, qtype, k)
        panels = ext.repack_panels(blocks, code, k)
        assert torch.equal(ext.panels_to_bf16(panels, code, n, k), ref.bfloat16())
        bias = torch.randn(n, generator=g)
        for m in (1, 16, rows - 1):  # the int8 panels, bit for bit
            x = torch.randn(m, k, generator=g)
            assert torch.equal(ext.quant_linear_panels(x, panels, code, n, amx, bias),
                               ext.quant_linear_panels(x, panels, code, n, vnni, bias))
        for m in (rows, 200):
            x = torch.randn(m, k, generator=g) * 3
            want = torch.nn.functional.linear(x.bfloat16().double(), ref.bfloat16().double())
            got = ext.quant_linear_panels(x, panels, code, n, amx, bias).double()
            torch.testing.assert_close(got - bias.double(), want, rtol=2**-7, atol=1e-2)


def test_activation_quantization_is_llama_cpp_q8() -> None:
    x = torch.tensor([[0.0] * 32 + [1.0, -2.54] + [0.5] * 30])
    qx, dx, sx = quant.quantize_activations_reference(x)
    assert qx[0, 0].abs().sum() == 0 and dx[0, 0] == 0 and sx[0, 0] == 0
    assert dx[0, 1] == torch.tensor(2.54) / 127
    assert qx[0, 1, :3].tolist() == [50, -127, 25]  # 1 / 0.02 = 50, 0.5 / 0.02 = 25
    assert sx[0, 1] == dx[0, 1] * float(qx[0, 1].sum())


@pytest.mark.parametrize("qtype", FORMATS)
def test_quant_linear_small_and_large_batches(qtype: str) -> None:
    """Decode batches through the kernel, prefill batches through the fp32 GEMM (or, on a path
    with int8 activations, every batch through the panels): each equals its reference; fused
    projections concatenate their rows."""
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g)
    kernel = pack_linear([w1, w2], [None, None], weight_format=qtype)
    assert isinstance(kernel, QuantLinear) and kernel.out_features == 96
    parts = [quant.quantize_reference(w, qtype) for w in (w1, w2)]
    ref = torch.cat([quant.dequantize_reference(b, qtype, 128) for b in parts])
    assert torch.equal(kernel.dequantize(), ref)
    int8_activations = (quant.default_isa() in quant.INT8_ACTIVATION_ISAS
                        and quant.quant_extension() is not None)
    amx_rows = quant.amx_rows() if quant.default_isa() == "avx512vnni_amx" else None
    for m in (1, 7, QuantLinear.SMALL_M + 1, 100):
        x = torch.randn(m, 128, generator=g)
        if amx_rows is not None and m >= amx_rows:  # bf16 on the AMX tiles
            want = (x.bfloat16().double() @ ref.bfloat16().double().T).float()
            torch.testing.assert_close(kernel(x), want, rtol=2**-7, atol=1e-2)
        elif int8_activations:
            want = quant.quant_linear_int8_reference(x, torch.cat(parts), qtype, 128).float()
            torch.testing.assert_close(kernel(x), want, rtol=1e-5, atol=1e-4)
        else:
            torch.testing.assert_close(kernel(x), x @ ref.T, rtol=1e-5, atol=1e-4)


def test_quant_isa_can_be_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant.ISA_ENV, "generic")
    assert quant.default_isa() == "generic"
    monkeypatch.setenv(quant.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="this CPU runs"):
        quant.default_isa()


def test_attached_gguf_blocks_are_used_as_stored() -> None:
    w = torch.randn(16, 64)
    stored = quant.quantize_reference(w, "q8_0")
    attach_gguf_blocks(w, "q8_0", stored)
    kernel = pack_linear([w], [None], weight_format="q4_1")  # Q8_0 is kept: more precise
    assert isinstance(kernel, QuantLinear) and kernel.qtype == "q8_0"
    assert torch.equal(kernel.blocks, stored)


def test_int8_prefill_batches_take_the_float_gemm() -> None:
    from pdserve.engine.linear import Int8DynamicLinear

    w = torch.randn(48, 64)
    kernel = pack_linear([w], [None], weight_format="int8")
    assert isinstance(kernel, Int8DynamicLinear)
    x = torch.randn(Int8DynamicLinear.SMALL_M + 8, 64)
    deq = kernel.dequantize()
    torch.testing.assert_close(kernel(x), x @ deq.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernel(x[:2]), x[:2] @ deq.T, rtol=0.02, atol=0.05)


@pytest.mark.slow
def test_gguf_blocks_are_the_checkpoint(model_dir: Path) -> None:
    """The default model's GGUF blocks, rows restored to Hugging Face order, dequantize bitwise
    to the float32 checkpoint the engine loads (so q4_1 multiplies exactly those weights)."""
    from safetensors.torch import load_file

    from pdserve.engine import model_store

    found = model_store.gguf_blocks(model_store.model_gguf(model_dir), 9, 3)
    state = load_file(str(model_dir / "model.safetensors"))
    assert {q for q, _ in found.values()} == {"q4_1", "q8_0"}
    assert len(found) == 30 * 7 + 1
    for name, (qtype, blocks) in found.items():
        w = state[name]
        assert torch.equal(quant.dequantize_reference(blocks, qtype, w.shape[1]), w), name
