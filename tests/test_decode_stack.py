"""The C++ layer loop (cpu_ops.cpp's DecodeStack) against the model's Python layer loop.

Both make the same kernel calls in the same order, so a step's outputs must be the same bits
either way: checked on the real default model, float32, int8 (fbgemm) and a quantized format,
with sequences of different lengths decoding together, prompts split into chunks (pieces that
attend over context already in the pool) and steps that mix prompt pieces with decodes. Token
identity with transformers runs through it too (test_engine_reference, test_engine_archs:
steps take the C++ loop by default).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kernels import FusedCpuKernels, kernels_for, quant
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.llama import DECODE_LOOP_ENV, LlamaForCausalLM
from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, run_to_end


class _Counting:
    """Forwards to a DecodeStack and counts its runs."""

    def __init__(self, stack: Any):
        self.stack, self.runs = stack, 0

    def run(self, *args: Any) -> None:
        self.runs += 1
        self.stack.run(*args)


def _both_loops(engine: LLMEngine, prompts: list[list[int]]) -> None:
    model = engine.runner.model
    if not model.has_decode_stack:
        pytest.skip("no C++ decode loop here (no fused kernels or quantized panels)")
    counting = _Counting(model._stack)
    model._stack = counting
    outs = []
    try:
        for on in (True, False):
            model.decode_stack_on = on
            events = run_to_end(engine, [GenerateRequest(f"{on}-{i}", tuple(ids),
                                                         greedy(12, logprobs=3))
                                         for i, ids in enumerate(prompts)])
            outs.append([[(e.token_id, e.logprob) for e in events[f"{on}-{i}"]]
                         for i in range(len(prompts))])
            if on:
                assert counting.runs >= 11  # every step took it
                runs = counting.runs
        assert counting.runs == runs  # and none while it was off
    finally:
        model._stack = counting.stack
        model.decode_stack_on = True
    assert outs[0] == outs[1]  # tokens and logprobs, bit for bit


def test_float32_same_bits_as_the_python_loop(make_engine: Any,
                                              prompt_ids: list[list[int]]) -> None:
    # 96-token steps: the 300-token prompt goes in chunks, beside the others' decodes
    engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=96,
                         max_prefill_chunk=64, step_target_ms=0.0)
    _both_loops(engine, [prompt_ids[0], prompt_ids[3], prompt_ids[-1][:300]])


def test_quantized_same_bits_as_the_python_loop(model_dir: Path,
                                                prompt_ids: list[list[int]]) -> None:
    if quant.quant_extension() is None or quant.default_isa() not in quant.INT8_ACTIVATION_ISAS:
        pytest.skip("the quantized panels need AVX2 or AVX-512 VNNI and the extension")
    engine = LLMEngine.from_dir(model_dir, EngineConfig(
        dtype="q4_1", kv_cache_bytes=64 << 20, enable_prefix_caching=False,
        max_num_batched_tokens=96, max_prefill_chunk=64, step_target_ms=0.0))
    _both_loops(engine, [prompt_ids[1], prompt_ids[2], prompt_ids[-1][:200]])
    assert engine.block_manager.num_free_blocks == engine.layout.num_blocks


def test_int8_same_bits_as_the_python_loop(model_dir: Path,
                                           prompt_ids: list[list[int]]) -> None:
    # fbgemm's int8 GEMM for the decodes, the int8 panels (panel_linear_i8) for 64-token chunks
    engine = LLMEngine.from_dir(model_dir, EngineConfig(
        dtype="int8", kv_cache_bytes=64 << 20, enable_prefix_caching=False,
        max_num_batched_tokens=96, max_prefill_chunk=64, step_target_ms=0.0))
    _both_loops(engine, [prompt_ids[1], prompt_ids[2], prompt_ids[-1][:200]])
    assert engine.block_manager.num_free_blocks == engine.layout.num_blocks


def test_python_loop_where_asked(loaded_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model: LlamaForCausalLM = loaded_model[0]
    monkeypatch.setenv(DECODE_LOOP_ENV, "python")
    assert model._decode_stack() is None


def test_a_foreign_or_malformed_kernel_is_refused() -> None:
    fused = kernels_for(torch.device("cpu"), torch.float32)
    if not isinstance(fused, FusedCpuKernels):
        pytest.skip("fused CPU kernels could not be built here")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"somebody.else")  # the capsule keeps a pointer to it
    target = ctypes.c_int(0)
    capsule = new(ctypes.addressof(target), ctypes.addressof(name), None)
    spec = (torch.zeros(1, dtype=torch.uint8), 16, None, capsule, 0, 0)
    stack = fused.decode_stack(9, 3, 64, 0.125)
    with pytest.raises(RuntimeError, match="capsule"):
        stack.add_layer(spec, spec, spec, spec, torch.ones(576), 1e-5, torch.ones(576), 1e-5)
    assert stack.num_layers == 0
    bad_int8 = (torch.zeros(16, 576, dtype=torch.int8), 16, None, (None, None), 0, 0)
    with pytest.raises(RuntimeError, match="int8 kernel"):
        stack.add_layer(bad_int8, bad_int8, bad_int8, bad_int8, torch.ones(576), 1e-5,
                        torch.ones(576), 1e-5)
    assert stack.num_layers == 0
