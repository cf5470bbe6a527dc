"""The fused CPU kernels and the weight formats against their references (engine.kernels,
engine.linear). Model-level token identity is in test_engine_reference / test_engine_archs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.cpu import DISABLE_AMX_ENV, amx_gemm
from pdserve.engine.kernels import FusedCpuKernels, TorchKernels, kernels_for
from pdserve.engine.linear import DenseLinear, OneDnnLinear, PanelLinear, pack_linear

REF = TorchKernels()


@pytest.fixture(scope="module")
def fused() -> FusedCpuKernels:
    k = kernels_for(torch.device("cpu"), torch.float32)
    if not isinstance(k, FusedCpuKernels):
        pytest.skip("fused CPU kernels could not be built here")
    return k


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_norms(fused: FusedCpuKernels) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g) * 3
    w = torch.rand(576, generator=g) + 0.5
    _close(fused.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    delta = torch.randn(7, 576, generator=g)
    r1, r2 = x.clone(), x.clone()
    _close(fused.add_rms_norm_(r1, delta, w, 1e-5), REF.add_rms_norm_(r2, delta, w, 1e-5))
    _close(r1, r2)  # the residual was updated in place by both


def test_rope_and_silu(fused: FusedCpuKernels) -> None:
    g = torch.Generator().manual_seed(1)
    n, heads, kv, d = 5, 9, 3, 64
    qkv = torch.randn(n, heads + 2 * kv, d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    a, b = qkv.clone(), qkv.clone()
    fused.rope_(a, heads + kv, cos, sin)
    REF.rope_(b, heads + kv, cos, sin)
    _close(a, b)
    assert torch.equal(a[:, heads + kv:], qkv[:, heads + kv:])  # v heads untouched
    gu = torch.randn(4, 2 * 1536, generator=g) * 4
    _close(fused.silu_mul(gu), REF.silu_mul(gu))
    gu = torch.randn(3, 2 * 37, generator=g)  # rows of vector tiles, a tail, gates far out
    gu[:, :37] = torch.linspace(-200, 200, 111).view(3, 37)
    _close(fused.silu_mul(gu), REF.silu_mul(gu))
    _close(fused.silu_mul(gu[1:, :]), REF.silu_mul(gu[1:, :]))


@pytest.mark.parametrize(("lens", "d"), [
    ([1], 64), ([5, 17, 33], 64), ([16, 48], 64),
    ([1000], 64), ([3, 600, 1500], 64), ([40, 1300], 128),  # contexts split into spans
    ([5, 17, 33], 48), ([700], 48),  # head dims off the 16-wide vector path
])
def test_paged_decode_attention_in_place(fused: FusedCpuKernels, lens: list[int],
                                         d: int) -> None:
    """Reads K/V through block tables (scattered, shared-prefix blocks) like the reference
    gather + SDPA, with GQA and a strided query view out of a packed q/k/v tensor; long
    contexts (merged from spans computed apart) and head dims the vector path does not take."""
    g = torch.Generator().manual_seed(2)
    layers, bs, kv, heads = 3, 16, 3, 9
    nblocks = len(lens) * -(-max(lens) // bs) + 8
    pool = torch.randn(nblocks, layers, 2, bs, kv, d, generator=g)
    layer = pool[:, 1]
    max_blocks = -(-max(lens) // bs)
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    for i, n in enumerate(lens):
        tables[i, : -(-n // bs)] = perm[i * max_blocks : i * max_blocks + -(-n // bs)]
    tables[-1, 0] = tables[0, 0]  # two sequences sharing a prefix block
    lens_t = torch.tensor(lens)
    span = torch.arange(max_blocks * bs)
    mask = torch.zeros(len(lens), 1, 1, max_blocks * bs).masked_fill(
        (span[None, :] >= lens_t[:, None])[:, None, None, :], float("-inf"))
    qkv = torch.randn(len(lens), heads + 2 * kv, d, generator=g)
    q = qkv[:, :heads]  # strided, as the model passes it
    got = fused.decode_attention(q, layer, tables, lens_t, mask, d**-0.5)
    want = REF.decode_attention(q, layer, tables, lens_t, mask, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # fetching the next task's K and V ahead changes no bit
    for prefetch in (False, True):
        assert torch.equal(fused._ext.paged_decode_attention(
            q, layer, tables, lens_t, d**-0.5, prefetch=prefetch), got)


def test_attention_prefetch_is_measured_once_and_kept(
        fused: FusedCpuKernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the decode attention prefetches: the environment decides where it says;
    otherwise measured once per build (both variants timed on this machine) and read back."""
    monkeypatch.setattr(kernels, "_build_dir", lambda: tmp_path / "build")
    for forced in ("0", "1"):
        monkeypatch.setenv(kernels.PREFETCH_ENV, forced)
        kernels.attention_prefetch.cache_clear()
        assert kernels.attention_prefetch() is (forced == "1")
    assert not (tmp_path / "build").exists()  # nothing measured
    monkeypatch.delenv(kernels.PREFETCH_ENV)
    kernels.attention_prefetch.cache_clear()
    choice = kernels.attention_prefetch()
    kept = json.loads((tmp_path / "build" / "attention_prefetch.json").read_text())
    assert kept["on_ms"] > 0 and kept["off_ms"] > 0
    assert choice is kept["prefetch"] is (kept["on_ms"] < kept["off_ms"])

    def no_measuring(*args: object, **kwargs: object) -> dict[str, float]:
        raise AssertionError("measured again")

    monkeypatch.setattr(kernels, "measure_attention_prefetch", no_measuring)
    for kept_choice in (True, False):  # read back, whatever it says
        (tmp_path / "build" / "attention_prefetch.json").write_text(
            json.dumps({"prefetch": kept_choice}))
        kernels.attention_prefetch.cache_clear()
        assert kernels.attention_prefetch() is kept_choice
    kernels.attention_prefetch.cache_clear()  # later tests measure (or read) the real one


def test_write_kv_matches(fused: FusedCpuKernels) -> None:
    g = torch.Generator().manual_seed(3)
    pool = torch.zeros(6, 2, 2, 4, 3, 8)
    qkv = torch.randn(5, 9 + 6, 8, generator=g)
    k, v = qkv[:, 9:12], qkv[:, 12:]
    blocks, offs = torch.tensor([0, 0, 5, 2, 2]), torch.tensor([0, 3, 1, 2, 3])
    a, b = pool.clone(), pool.clone()
    fused.write_kv(a[:, 1], k, v, blocks, offs)
    REF.write_kv(b[:, 1], k, v, blocks, offs)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.write_kv(a[:, 1], k, v, torch.tensor([0, 0, 6, 2, 2]), offs)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_packed_linear_fuses_projections(fmt: str) -> None:
    g = torch.Generator().manual_seed(4)
    ws = [torch.randn(o, 64, generator=g) * 0.1 for o in (32, 16, 16)]
    bs = [torch.randn(o, generator=g) for o in (32, 16, 16)]
    kernel = pack_linear(ws, bs, weight_format=fmt)
    x = torch.randn(5, 64, generator=g)
    want = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)], dim=-1)
    got = kernel(x)
    tol = 1e-5 if fmt == "float32" else 0.03 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    assert kernel.nbytes == sum(w.numel() for w in ws) * (4 if fmt == "float32" else 1)


@pytest.mark.parametrize("n,k", [(96, 64), (50, 17), (1, 3), (33, 160)])
def test_panel_linear_against_float64(fused: FusedCpuKernels, n: int, k: int) -> None:
    """Every batch size the tile split meets (whole tiles, each remainder, one row), ragged
    last panels, with and without a bias, against the float64 product."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    kernel = pack_linear([w], [b], weight_format="float32")
    assert isinstance(kernel, PanelLinear)
    no_bias = PanelLinear(w, None, fused._ext)
    for m in (*range(1, 18), 31, 64):
        x = torch.randn(m, k, generator=g)
        want = F.linear(x.double(), w.double())
        torch.testing.assert_close(no_bias(x).double(), want, rtol=0, atol=1e-5 * k ** 0.5)
        torch.testing.assert_close(kernel(x).double(), want + b.double(), rtol=0,
                                   atol=1e-5 * k ** 0.5)
    x = torch.randn(4, 2 * k, generator=g)[:, ::2]  # strided rows are copied, not misread
    torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=0, atol=1e-5 * k ** 0.5)
    x = torch.randn(2, 3, k, generator=g)  # leading dims kept
    assert kernel(x).shape == (2, 3, n)


@pytest.mark.parametrize("n,k,m", [(64, 1536, 700), (96, 64, 301), (50, 17, 301)])
def test_panel_linear_rows_do_not_depend_on_batchmates(fused: FusedCpuKernels, n: int, k: int,
                                                         m: int) -> None:
    """A batch whose x outgrows half of L2 (700 x 1536 floats: 4.3 MB) takes the cache-blocked
    loop, in several row blocks and row tiles of another height; smaller ones one pass. Each
    row's result is the same bits as alone: what lets the prefill and decode workers, and
    every step mix, write the same KV."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    kernel = PanelLinear(w, b, fused._ext)
    x = torch.randn(m, k, generator=g)
    whole = kernel(x)
    for i in range(0, m, 7):
        assert torch.equal(kernel(x[i:i + 7]), whole[i:i + 7])
    assert torch.equal(kernel(x[5:6]), whole[5:6])


@pytest.mark.parametrize("n,k,ms", [(96, 64, (33, 64, 301)), (50, 17, (40, 301)),
                                     (64, 1536, (33, 700)), (2048, 1536, (400,))])
@pytest.mark.parametrize("threads", [1, 0])
def test_int8_panels_are_the_float_panels_over_the_dequantized_weights(
        fused: FusedCpuKernels, n: int, k: int, ms: tuple[int, ...], threads: int) -> None:
    """Int8DynamicLinear's prefill-sized batches (panel_linear_i8: each int8 panel dequantized
    once per call) give the same bits as the fp32 panels over the weights dequantized up
    front: in one pass, ragged, and cache-blocked (700 and 400 rows of 1536 floats), where
    the blocked path keeps a thread's dequantized panels for the call and, on one thread,
    where 2048 rows of weights are more than it keeps (cpu_ops.cpp KEEP_MAX) and each panel
    is dequantized again per block of rows. threads 0: torch's own count."""
    if threads:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _int8_panels_match(fused, n, k, ms)
        finally:
            torch.set_num_threads(before)
    else:
        _int8_panels_match(fused, n, k, ms)


def _int8_panels_match(fused: FusedCpuKernels, n: int, k: int, ms: tuple[int, ...]) -> None:
    from pdserve.engine.linear import Int8DynamicLinear

    g = torch.Generator().manual_seed(n * 7 + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    with mock.patch.dict(os.environ, {DISABLE_AMX_ENV: "1"}):  # the panels, not the tiles
        kernel = Int8DynamicLinear(w, b)
    deq = kernel.dequantize()
    assert deq.shape == (n, k)
    torch.testing.assert_close(deq, w, rtol=0, atol=w.abs().max().item() / 127)
    floats = PanelLinear(deq, b, fused._ext)
    for m in ms:
        assert m > Int8DynamicLinear.SMALL_M
        x = torch.randn(m, k, generator=g)
        assert torch.equal(kernel(x), floats(x)), m
    with pytest.raises(RuntimeError, match="scales must be"):
        fused._ext.panel_linear_i8(x, kernel._qweight, kernel._scales[:-1], n, None)


@pytest.mark.skipif(not amx_gemm(), reason="no AMX (amx_bf16) on this CPU")
@pytest.mark.parametrize(("n", "k"), [(96, 64), (50, 17), (2048, 576)])
def test_int8_amx_path_is_a_bf16_gemm_over_the_exact_weights(
        fused: FusedCpuKernels, n: int, k: int) -> None:
    """On a CPU with AMX, Int8DynamicLinear's batches from AMX_ROWS rows: the int8 weights
    (exact in bf16) times x rounded to bf16, the output rounded to bf16 (oneDNN's GEMM), then
    scales and bias in float32; smaller prefill batches stay on the exact int8 panels."""
    from pdserve.engine.linear import Int8DynamicLinear

    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    kernel = Int8DynamicLinear(w, b)
    deq = kernel.dequantize()
    q = (deq / kernel._scales[:, None]).round()
    floats = PanelLinear(deq, b, fused._ext)
    x = torch.randn(Int8DynamicLinear.AMX_ROWS - 1, k, generator=g)
    assert torch.equal(kernel(x), floats(x))
    for m in (Int8DynamicLinear.AMX_ROWS, 300):
        x = torch.randn(m, k, generator=g)
        exact = x.bfloat16().double() @ q.double().T
        got = (kernel(x) - b).double() / kernel._scales.double()
        torch.testing.assert_close(got, exact, rtol=2**-7, atol=1e-2)


def test_float32_without_the_extension_uses_onednn(monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_DISABLE_CPU_KERNELS", "1")
    w = torch.randn(48, 64)
    kernel = pack_linear([w], [None], weight_format="float32")
    assert isinstance(kernel, (OneDnnLinear, DenseLinear))
    x = torch.randn(3, 64)
    torch.testing.assert_close(kernel(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_int8_rows_do_not_depend_on_batchmates() -> None:
    """fbgemm quantizes activations with one range per call; the kernel pins that range, so
    a row's result is the same alone and next to a row with a 1000x larger range."""
    g = torch.Generator().manual_seed(5)
    kernel = pack_linear([torch.randn(48, 64, generator=g)], [None], weight_format="int8")
    x = torch.randn(1, 64, generator=g)
    loud = torch.randn(1, 64, generator=g) * 1000
    assert torch.equal(kernel(x)[0], kernel(torch.cat((loud, x)))[1])


def test_dense_fallback_and_bad_format() -> None:
    w = torch.randn(8, 4)
    assert isinstance(pack_linear([w], [None], weight_format="float16"), DenseLinear)
    with pytest.raises(ValueError, match="unknown weight format"):
        pack_linear([w], [None], weight_format="int3")


def test_int8_fused_rows_match_torch_path(fused: FusedCpuKernels, monkeypatch) -> None:
    g = torch.Generator().manual_seed(6)
    kernel = pack_linear([torch.randn(48, 64, generator=g)], [torch.randn(48, generator=g)],
                         weight_format="int8")
    x = torch.randn(3, 64, generator=g) * 5
    got = kernel(x)
    monkeypatch.setattr(kernel, "_ext", None)
    torch.testing.assert_close(got, kernel(x), rtol=1e-5, atol=1e-5)


def test_killed_build_does_not_block_later_loads(tmp_path, monkeypatch) -> None:
    """torch's builder leaves a `lock` file when a build is killed; the next load must not
    wait on it forever (our flock proves nobody else is building)."""
    import shutil

    from pdserve.engine import kernels

    built = kernels.cpu_extension()
    if built is None:
        pytest.skip("the CPU kernels cannot be built here")
    name = built.__name__
    shutil.copytree(kernels._build_root() / name, tmp_path / name)
    (tmp_path / name / "lock").write_text("")  # what a SIGKILLed build leaves behind
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ext = kernels._build.__wrapped__()
    assert ext is not None
    assert not (tmp_path / name / "lock").exists()
