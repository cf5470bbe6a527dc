"""Paged attention over the block-major KV pool.

The pool is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(see pdserve.kv_layout.KVLayout). Each step writes the new tokens' K/V into their slots, then
attends over each sequence's whole context read back through its block table.

Two implementations share that contract: a torch CPU/any-device path that is always
available, and a flash-attn varlen path used only when CUDA and flash_attn are present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import TorchKernels, gather_blocks

try:  # pragma: no cover - only on CUDA machines with flash-attn installed
    from flash_attn import flash_attn_varlen_func

    HAVE_FLASH_ATTN = torch.cuda.is_available()
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None
    HAVE_FLASH_ATTN = False


_REFERENCE = TorchKernels()


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what each sequence attends to.

    Tokens are packed: prefill pieces first (``prefill_lens`` tokens each, in order), then
    one token per decoding sequence.
    """

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    prefill_lens: list[int]  # new tokens per prefill piece
    prefill_starts: list[int]  # position of each piece's first token
    prefill_block_tables: list[torch.Tensor]  # per piece: [num_blocks_of_context]
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] (padded with 0)
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] additive
    use_flash: bool = False


def _gather(kv_layer: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``length`` tokens as [kv_heads, length, head_dim]."""
    k = gather_blocks(kv_layer, 0, block_table).flatten(0, 1)[:length]
    v = gather_blocks(kv_layer, 1, block_table).flatten(0, 1)[:length]
    return k.transpose(0, 1), v.transpose(0, 1)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
                    kernels: TorchKernels = _REFERENCE) -> torch.Tensor:
    """q: [num_tokens, heads, head_dim]; returns [num_tokens, heads, head_dim].

    Writes the new tokens' K/V into their slots first, so every piece sees its own keys."""
    kernels.write_kv(kv_layer, k_new, v_new, meta.slot_blocks, meta.slot_offsets)
    if meta.use_flash:
        return _flash_attention(q, kv_layer, meta, scale)
    if not meta.prefill_lens:  # decode-only step: no copy into a packed output
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        assert meta.decode_mask is not None
        return kernels.decode_attention(q, kv_layer, meta.decode_block_tables,
                                        meta.decode_context_lens, meta.decode_mask, scale)
    out = torch.empty_like(q)
    pos = 0
    for n, start, table in zip(meta.prefill_lens, meta.prefill_starts,
                               meta.prefill_block_tables, strict=True):
        qs = q[pos : pos + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        if start == 0:  # whole context is new: attend over the fresh K/V, plain causal
            ks = k_new[pos : pos + n].transpose(0, 1).unsqueeze(0)
            vs = v_new[pos : pos + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            k, v = _gather(kv_layer, table, start + n)
            # Query i sits at position start + i and sees keys 0 .. start + i.
            mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
            o = F.scaled_dot_product_attention(qs, k.unsqueeze(0), v.unsqueeze(0),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        out[pos : pos + n] = o[0].transpose(0, 1)
        pos += n
    if meta.num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        assert meta.decode_mask is not None
        b = meta.num_decodes
        out[pos : pos + b] = kernels.decode_attention(
            q[pos : pos + b], kv_layer, meta.decode_block_tables, meta.decode_context_lens,
            meta.decode_mask, scale)
    return out


def _flash_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:  # pragma: no cover - needs CUDA
    """Gather each sequence's context contiguously and run flash-attn's varlen kernel."""
    assert flash_attn_varlen_func is not None
    ks, vs, q_lens, k_lens = [], [], [], []
    for n, start, table in zip(meta.prefill_lens, meta.prefill_starts,
                               meta.prefill_block_tables, strict=True):
        k, v = _gather(kv_layer, table, start + n)
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
        q_lens.append(n)
        k_lens.append(start + n)
    if meta.num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        for table, length in zip(meta.decode_block_tables, meta.decode_context_lens.tolist(),
                                 strict=True):
            k, v = _gather(kv_layer, table, length)
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
            q_lens.append(1)
            k_lens.append(length)
    dev = q.device
    cu_q = F.pad(torch.tensor(q_lens, device=dev).cumsum(0), (1, 0)).to(torch.int32)
    cu_k = F.pad(torch.tensor(k_lens, device=dev).cumsum(0), (1, 0)).to(torch.int32)
    # causal=True aligns the causal mask to the bottom right, i.e. queries are the last tokens.
    return flash_attn_varlen_func(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, max(q_lens),
                                  max(k_lens), softmax_scale=scale, causal=True)
