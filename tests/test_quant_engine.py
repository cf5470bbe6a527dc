"""`--dtype q4_1` / `q8_0` on the real model: the GGUF's own blocks, bounded disagreement.

The default model's float32 checkpoint is the dequantization of its Q4_1 GGUF, so q4_1 with float
activations runs the very same weights in another summation order: agreement with float32 must be
near total. On AVX2 and AVX-512 VNNI CPUs the default path also rounds activations to 8 bits.
q8_0 requantizes those 4-bit weights to 8 bits (the GGUF's Q8_0 embedding is kept as stored).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.quality import measure
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import cpu_info
from pdserve.engine.kernels import quant
from pdserve.engine.linear import QuantLinear
from pdserve.engine.llm_engine import LLMEngine


@pytest.mark.slow
def test_q4_1_engine_runs_the_gguf_blocks(model_dir: Path) -> None:
    eng = LLMEngine.from_dir(model_dir, EngineConfig(dtype="q4_1", num_kv_blocks=8))
    assert eng.layout.model_id.endswith("+q4_1")  # KV from other weights is never mixed in
    assert eng.layout.dtype == "float32"
    model = eng.runner.model
    gate_up = model.model.layers[0].mlp.gate_up
    assert isinstance(gate_up, QuantLinear) and gate_up.qtype == "q4_1"
    assert isinstance(model.head, QuantLinear) and model.head.qtype == "q8_0"
    # ~66 MB of Q4_1 projections + ~30 MB of the Q8_0 head, against 538 MB in float32.
    assert model.weight_nbytes() < 100e6


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_quantized_formats_stay_close_to_float32(model_dir: Path, activations: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With float32 activations (the dequantized weights exactly), and with int8 activations
    (the panels, llama.cpp's arithmetic: bounds from bench.quality's measurement)."""
    widest = quant.isa_for(cpu_info())
    if activations == "int8" and widest not in quant.INT8_ACTIVATION_ISAS:
        pytest.skip("this CPU has no int8-activation path")
    monkeypatch.setenv(quant.ISA_ENV, widest if activations == "int8"
                       else quant.FLOAT_PATH_OF.get(widest, widest))
    ref, q41, q80 = measure(model_dir, ["q4_1", "q8_0"], n_prompts=4, tokens=16,
                            ppl_window=256)
    exact = activations == "float32"
    assert q41.teacher_forced_top1 >= (0.98 if exact else 0.9)  # 64 positions here
    assert abs(q41.perplexity - ref.perplexity) <= ref.perplexity * (0.002 if exact else 0.005)
    assert q80.teacher_forced_top1 >= 0.9
    assert q80.perplexity <= ref.perplexity * 1.02
