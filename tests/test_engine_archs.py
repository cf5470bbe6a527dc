"""Every architecture the engine claims, against transformers on small random models.

Each model is built from a config with random weights (nothing is downloaded), saved as
safetensors and loaded by engine.loader, so config parsing, weight names and the arithmetic
are all checked. Biases and norm weights are randomised too: transformers initialises them
to 0 and 1, which would hide a missing q/k/v bias or a swapped QK-norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.errors import UnsupportedArchitectureError
from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, run_to_end, tokens

SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_hidden_layers=2, intermediate_size=128, initializer_range=0.2,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "llama": ("LlamaConfig", {}),
    "llama-tied-llama3-rope": ("LlamaConfig", {"tie_word_embeddings": True,
                                              "rope_parameters": LLAMA3_ROPE}),
    "llama-attention-mlp-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3-tied-attention-bias": ("Qwen3Config", {"tie_word_embeddings": True,
                                                  "attention_bias": True}),
}
NEW_TOKENS = 16


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 21, 40)]


def _build_hf(config_cls: str, overrides: dict[str, Any], out_dir: Path) -> Any:
    import transformers

    cfg = getattr(transformers, config_cls)(**{**SMALL, **overrides})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.eval()
    hf.save_pretrained(out_dir, safe_serialization=True)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """(transformers model, our model, our ModelConfig) with the same random weights."""
    config_cls, overrides = CASES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    hf = _build_hf(config_cls, overrides, out)
    ours, config = load_model(out)
    return hf, ours, config


def _our_prefill_logits(model: Any, config: Any, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one fresh prompt, straight through the model."""
    bs, n = 16, len(ids)
    nb = -(-n // bs)
    pool = torch.zeros(nb, config.num_layers, 2, bs, config.num_kv_heads, config.head_dim,
                       dtype=model.activation_dtype)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_blocks=pos // bs, slot_offsets=pos % bs, prefill_lens=[n], prefill_starts=[0],
        prefill_block_tables=[torch.arange(nb)], num_decodes=0, decode_block_tables=None,
        decode_context_lens=None, decode_mask=None)
    with torch.inference_mode():
        return model(torch.tensor(ids), pos, pool, meta, pos)


def test_config_flags(pair) -> None:  # type: ignore[no-untyped-def]
    hf, packed, config = pair
    assert packed.head is not None and packed.weight_format == "float32"
    # Module names must match the checkpoint's: check the structure the loader fills in.
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
    hc = hf.config
    assert config.tie_word_embeddings == hc.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hc.tie_word_embeddings
    assert config.qk_norm == (hc.model_type == "qwen3")
    assert config.attention_bias == (ours.model.layers[0].self_attn.q_proj.bias is not None)
    for ours_mod, hf_mod in ((ours.model.layers[0].self_attn, hf.model.layers[0].self_attn),
                             (ours.model.layers[0].mlp, hf.model.layers[0].mlp)):
        for name, p in hf_mod.named_parameters():
            assert dict(ours_mod.named_parameters())[name].shape == p.shape
    assert set(dict(ours.named_parameters())) <= set(dict(hf.named_parameters())) | {
        "lm_head.weight"}
    rope = hc.rope_parameters.get("rope_type", "default")
    assert config.rope_scaling.kind == rope


def test_prefill_logits_match(pair) -> None:  # type: ignore[no-untyped-def]
    hf, ours, config = pair
    for ids in _prompts():
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        got = _our_prefill_logits(ours, config, ids)
        assert ref.abs().max() > 1.0  # real signal, not near-ties around 0
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_batched(pair) -> None:  # type: ignore[no-untyped-def]
    hf, ours, config = pair
    prompts = _prompts()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS, do_sample=False)
            expected.append(y[0, len(ids):].tolist())
    # Small chunks and blocks: chunked prefill over cached blocks, decode and prefill pieces
    # in one step, sequences spanning many blocks.
    engine = LLMEngine(ours, config, EngineConfig(block_size=8, num_kv_blocks=64,
                                                  max_num_batched_tokens=24, max_num_seqs=8,
                                                  max_prefill_chunk=16),
                       model_id="test", tokenizer=None)
    reqs = [GenerateRequest(f"r{i}", tuple(ids), greedy(NEW_TOKENS))
            for i, ids in enumerate(prompts)]
    out = run_to_end(engine, reqs)
    for req, ref in zip(reqs, expected, strict=True):
        assert tokens(out[req.request_id]) == ref, req.request_id
    assert engine.block_manager.num_free_blocks == engine.layout.num_blocks


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                               n_positions=32)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path)
    assert info.value.code == "unsupported_architecture"


def test_unsupported_rope_scaling_is_named(tmp_path: Path) -> None:
    _build_hf("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                  "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 64}},
              tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        load_model(tmp_path)


def test_loads_in_bfloat16(tmp_path: Path) -> None:
    hf = _build_hf("Qwen3Config", {"tie_word_embeddings": True}, tmp_path)
    ours, config = load_model(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = _prompts()[1]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    got = _our_prefill_logits(ours, config, ids)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    engine = LLMEngine(ours, config, EngineConfig(num_kv_blocks=16, dtype="bfloat16"),
                       model_id="test-bf16", tokenizer=None)
    out = run_to_end(engine, [GenerateRequest("bf16", tuple(ids), greedy(8))])
    assert len(tokens(out["bf16"])) == 8
