"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over the paged KV pool.

Submodule names match Hugging Face checkpoints, so weights load by name. After loading,
`pack()` turns the projections into prepared kernels (engine.linear): q/k/v and gate/up become
one GEMM each and the checkpoint-shaped `nn.Linear`s are dropped. The arithmetic follows
transformers' (fp32 RMSNorm, rotate-half RoPE), so greedy float32 outputs agree token for token.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.config import ModelConfig, RopeScaling
from pdserve.engine.kernels import FusedCpuKernels, TorchKernels, kernels_for
from pdserve.engine.linear import LinearKernel, detach_gguf_blocks, pack_linear

DECODE_LOOP_ENV = "PDSERVE_DECODE_LOOP"  # "python": never the C++ layer loop


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchKernels.rms_norm(x, self.weight, self.eps)


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind != "llama3":
        return inv
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * inv_llama / scaling.factor + smooth * inv_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a buffer (register_buffer), which nn.Module's typing cannot see

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv = _inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        # cos/sin of positions [0, len) per dtype, grown by doubling: a step looks them up
        # instead of computing transcendental functions for every token (same values).
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, upto: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._tables.get(dtype)
        if cached is not None and cached[0].shape[0] >= upto:
            return cached
        size = max(upto, 2 * cached[0].shape[0] if cached is not None else 4096)
        pos = torch.arange(size, device=self.inv_freq.device)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._tables[dtype] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._tables[dtype]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int) -> tuple[
            torch.Tensor, torch.Tensor]:
        cos, sin = self._table(max_position + 1, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv: LinearKernel | None = None
        self.o: LinearKernel | None = None

    def pack(self, weight_format: str) -> None:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv = pack_linear([p.weight for p in projs], [p.bias for p in projs],
                               weight_format=weight_format)
        self.o = pack_linear([self.o_proj.weight], [self.o_proj.bias],
                             weight_format=weight_format)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                kernels: TorchKernels) -> torch.Tensor:
        """`kv_layer`: this layer's K/V in the pool (kv_pool[:, layer_idx])."""
        assert self.qkv is not None and self.o is not None, "call LlamaForCausalLM.pack()"
        n = x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(n, h + 2 * hkv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, :h] = self.q_norm(qkv[:, :h])
            qkv[:, h:h + hkv] = self.k_norm(qkv[:, h:h + hkv])
        kernels.rope_(qkv, h + hkv, cos, sin)  # q and k heads, in place, in one pass
        q, k, v = qkv.split((h, hkv, hkv), dim=1)  # views, one call (three slices cost three)
        o = paged_attention(q, k, v, kv_layer, meta, self.scale, kernels)
        return self.o(o.reshape(n, h * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: LinearKernel | None = None
        self.down: LinearKernel | None = None

    def pack(self, weight_format: str) -> None:
        self.gate_up = pack_linear([self.gate_proj.weight, self.up_proj.weight],
                                   [self.gate_proj.bias, self.up_proj.bias],
                                   weight_format=weight_format)
        self.down = pack_linear([self.down_proj.weight], [self.down_proj.bias],
                                weight_format=weight_format)
        del self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x: torch.Tensor, kernels: TorchKernels) -> torch.Tensor:
        assert self.gate_up is not None and self.down is not None, "call pack()"
        return self.down(kernels.silu_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # nn.ModuleList is not generic (its items type as Module): typed as what it holds.
        self.layers = cast(Sequence[DecoderLayer], nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_layers)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


@dataclass(frozen=True)
class _LayerStep:
    """What the forward loop reads of one decoder layer, gathered once by `pack()`."""

    attn: Attention
    mlp: MLP
    norm_weight: torch.Tensor  # input_layernorm
    norm_eps: float
    post_weight: torch.Tensor  # post_attention_layernorm
    post_eps: float
    next_weight: torch.Tensor | None  # the next layer's input_layernorm (None: the last)
    next_eps: float


class LlamaForCausalLM(nn.Module):
    """Forward over packed tokens of many sequences; logits only where asked."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: LinearKernel | None = None
        self.weight_format = ""
        self.kernels = TorchKernels()
        # Set by pack(): each layer's modules and norm weights, read once per step without
        # nn.Module's attribute lookups and call hooks (~1 ms a decode step in Python).
        self._steps: list[_LayerStep] = []
        self._kv_views: tuple[torch.Tensor, bool, tuple[torch.Tensor, ...]] | None = None
        # Set by pack() where every layer can: the steps' layer loop in C++ (cpu_ops.cpp's
        # DecodeStack, named for the steps it was built for first), for the kernels it was
        # built with. `decode_stack_on` turns it off (benchmarks alternate the two loops);
        # PDSERVE_DECODE_LOOP=python never builds it.
        self._stack: Any = None
        self._stack_kernels: TorchKernels | None = None
        self.decode_stack_on = True

    @property
    def has_decode_stack(self) -> bool:
        """Steps can take the C++ layer loop (`decode_stack_on` says whether they do)."""
        return self._stack is not None

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @torch.no_grad()
    def pack(self, weight_format: str) -> LlamaForCausalLM:
        """Prepare every projection for `weight_format` (see engine.linear) and drop the
        checkpoint-shaped weights. Call once, after the weights are loaded."""
        if self.head is not None:
            raise RuntimeError("model is already packed")
        for layer in self.model.layers:
            layer.self_attn.pack(weight_format)
            layer.mlp.pack(weight_format)
        self.head = pack_linear([self.lm_head.weight], [None], weight_format=weight_format)
        del self.lm_head
        for param in self.parameters():  # the kernels hold their own copies now
            detach_gguf_blocks(param)
        layers = self.model.layers
        self._steps = [_LayerStep(
            attn=layer.self_attn, mlp=layer.mlp,
            norm_weight=layer.input_layernorm.weight, norm_eps=layer.input_layernorm.eps,
            post_weight=layer.post_attention_layernorm.weight,
            post_eps=layer.post_attention_layernorm.eps,
            next_weight=layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None,
            next_eps=layers[i + 1].input_layernorm.eps if i + 1 < len(layers) else 0.0)
            for i, layer in enumerate(layers)]
        self.weight_format = weight_format
        self.kernels = kernels_for(self.model.embed_tokens.weight.device, self.activation_dtype)
        self._stack = self._decode_stack()
        self._stack_kernels = self.kernels if self._stack is not None else None
        return self

    def _decode_stack(self) -> Any:
        """cpu_ops.cpp's DecodeStack over these layers, or None where a layer needs what it
        does not do (q/k norms, a linear kernel without a `step_spec`, no fused kernels)."""
        kernels = self.kernels
        config = self.config
        if (not isinstance(kernels, FusedCpuKernels) or config.qk_norm
                or os.environ.get(DECODE_LOOP_ENV) == "python"):
            return None
        stack = kernels.decode_stack(config.num_heads, config.num_kv_heads, config.head_dim,
                                     config.head_dim**-0.5)
        for step in self._steps:
            attn, mlp = step.attn, step.mlp
            assert attn.qkv and attn.o and mlp.gate_up and mlp.down
            specs = [k.step_spec() for k in (attn.qkv, attn.o, mlp.gate_up, mlp.down)]
            if any(spec is None for spec in specs):
                return None
            stack.add_layer(*specs, step.norm_weight, step.norm_eps, step.post_weight,
                            step.post_eps)
        return stack

    def weight_nbytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the LM head."""
        assert self.head is not None
        kernels: list[LinearKernel] = [self.head]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            kernels += [k for k in (attn.qkv, attn.o, mlp.gate_up, mlp.down) if k is not None]
        return sum(k.nbytes for k in kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                max_position: int | None = None) -> torch.Tensor:
        """Packed tokens of many sequences -> logits at ``logits_indices``. ``max_position``
        (the largest of ``positions``) saves a device sync when the caller knows it."""
        assert self.head is not None, "call pack()"
        kernels = self.kernels
        x = self.model.embed_tokens(input_ids)  # the residual stream, updated in place
        if max_position is None:
            max_position = int(positions.max())
        cos, sin = self.model.rotary_emb(positions, x.dtype, max_position)
        # The pool's per-layer views, made once per pool. One model may step for several
        # engines on their own threads (tests run a prefill and a decode engine on one
        # model), so the cache is one tuple read once and replaced whole, never mutated.
        mode = torch.is_inference_mode_enabled()  # views made in one mode stay in it
        views = self._kv_views
        if views is None or views[0] is not kv_pool or views[1] is not mode:
            views = self._kv_views = (kv_pool, mode, kv_pool.unbind(1))
        if (self._stack is not None and self.decode_stack_on and not meta.use_flash
                and kernels is self._stack_kernels):  # the same calls as below, from C++
            self._stack.run(x, cos, sin, views[2], meta.slot_blocks, meta.slot_offsets,
                            meta.prefill_lens, meta.prefill_starts, meta.prefill_block_tables,
                            meta.decode_block_tables, meta.decode_context_lens)
        else:
            steps = self._steps
            h = kernels.rms_norm(x, steps[0].norm_weight, steps[0].norm_eps)
            for step, kv_layer in zip(steps, views[2], strict=True):
                a = step.attn.forward(h, cos, sin, kv_layer, meta, kernels)
                h = kernels.add_rms_norm_(x, a, step.post_weight, step.post_eps)
                m = step.mlp.forward(h, kernels)
                if step.next_weight is not None:
                    h = kernels.add_rms_norm_(x, m, step.next_weight, step.next_eps)
                else:
                    x.add_(m)
        final = self.model.norm
        return self.head(kernels.rms_norm(x[logits_indices], final.weight, final.eps)).float()
