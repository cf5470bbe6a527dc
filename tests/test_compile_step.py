"""bench.compile_step's torch-ops decoder computes the engine's decode step: what the
benchmark compiles is the same model as the C++ layer loop it is timed against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import compile_step as cs
from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import cpu_extension
from pdserve.engine.llm_engine import LLMEngine


@pytest.mark.parametrize("panels", [False, True], ids=["dense", "engine-gemm"])
def test_the_torch_decoder_steps_as_the_cpp_loop_does(model_dir: Path, panels: bool) -> None:
    ext = cpu_extension()
    if ext is None:
        pytest.skip("no CPU extension: no C++ loop and no kernels to register")
    cs._EXT = ext
    engine = LLMEngine.from_dir(model_dir, EngineConfig(kv_cache_bytes=32 << 20))
    if not engine.runner.model.has_decode_stack:
        pytest.skip("this engine steps without the C++ loop")
    decoder = cs.TorchDecoder(model_dir, engine.model_config, engine.runner.model,
                              panels=panels).eval()
    a = cs._inputs(engine, batch=3, context=40)
    with torch.inference_mode():
        ref = cs._cpp_step(engine, a)
        pool_after_cpp = engine.kv_pool.clone()
        slots = a["slot_blocks"].long(), a["slot_offsets"].long()
        engine.kv_pool[slots[0], :, :, slots[1]] = 0  # the decoder must write them again
        out = decoder(a["ids"], a["positions"], engine.kv_pool, a["tables"], a["lens"],
                      a["slot_blocks"], a["slot_offsets"])
    assert out.shape == ref.shape == (3, engine.model_config.vocab_size)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    assert float((out - ref).abs().max()) < 1e-2
    # the new token's K/V went to the same slots (the custom op wrote the pool)
    diff = float((engine.kv_pool - pool_after_cpp).abs().max())
    assert diff < 1e-3, diff
