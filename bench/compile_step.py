"""A decode step as one `torch.compile`d graph against the C++ layer loop (issue 20 item 1).

    python -m bench.compile_step [--batches 1,16] [--context 200] [--steps 30] [--out F]

Issue 20 item 1 asks for the decode step without Python and dispatch, as a compiled graph or
as a C++ step loop, both measured and the faster kept. The engine has the C++ loop
(cpu_ops.cpp's DecodeStack). This measures the other one, float32, on this machine:

- `cpp_loop`: the engine's packed model, `LlamaForCausalLM.forward` (DecodeStack: the panel
  GEMMs, fused norms/RoPE, the extension's KV write and paged decode attention).
- `compiled`: the same decoder written as plain torch ops over the checkpoint's dense
  weights, compiled by inductor (CPU backend, `freezing`: weights folded in as constants,
  linears prepacked for oneDNN where it chooses to), one graph per batch size
  (`dynamic=False`, the bucketing a server would do). The KV write and the paged decode
  attention are the extension's own kernels, registered as custom ops
  (`pdserve_bench::write_kv`, `pdserve_bench::decode_attention`) so the graph calls them
  without a break. The KV write returns an empty tensor that the attention takes as an
  argument: the order between them is a data dependency, and the compiler is not told the
  pool is mutated (it would otherwise copy the pool to keep the graph functional).
- `compiled_panels`: the same graph with each projection a custom op
  (`pdserve_bench::linear`) calling the engine's own packed GEMM: the compiler then fuses
  only what lies between the kernels (norms, RoPE, SiLU, residual adds).
- `eager`: the torch-ops decoder uncompiled (what the compiler starts from).

Each graph is built per `--modes`: inductor's default, `max-autotune` (it times its own C++
GEMM templates against the library's and keeps the faster), and `cpp-wrapper` (the default
with the code that calls the kernels in C++ rather than Python).

Same inputs for all three (ids, positions, block tables, one new token per sequence after
`--context` tokens of random KV); the logits are compared (max |diff| and argmax). The three
take turns step by step; the table gives each one's median over `--steps` steps, and the
compile time (on this machine's cores, once per batch size).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from bench import commit_id
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.kernels import FusedCpuKernels, TorchKernels, cpu_extension
from pdserve.engine.linear import LinearKernel
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.engine.models.llama import LlamaForCausalLM, _inv_freq

_EXT: Any = None
CPP_WRAPPER = "cpp-wrapper"  # a --modes name: the default mode, its wrapper code in C++


@torch.library.custom_op("pdserve_bench::write_kv", mutates_args=())
def write_kv(pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> torch.Tensor:
    """The extension's KV write into `pool[:, layer]`; returns an empty tensor (see above)."""
    _EXT.write_kv(pool[:, layer], k.contiguous(), v.contiguous(), slot_blocks, slot_offsets)
    return torch.empty(0)


@write_kv.register_fake
def _(pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
      slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> torch.Tensor:
    return torch.empty(0)


@torch.library.custom_op("pdserve_bench::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, pool: torch.Tensor, layer: int, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float, written: torch.Tensor) -> torch.Tensor:
    """The extension's paged decode attention over `pool[:, layer]` (after `written`)."""
    out: torch.Tensor = _EXT.paged_decode_attention(q.contiguous(), pool[:, layer], tables,
                                                    lens, scale, True)
    return out


@decode_attention.register_fake
def _(q: torch.Tensor, pool: torch.Tensor, layer: int, tables: torch.Tensor,
      lens: torch.Tensor, scale: float, written: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


# The engine's packed projections (engine.linear kernels), called from a graph by index.
_KERNELS: list[LinearKernel] = []


@torch.library.custom_op("pdserve_bench::linear", mutates_args=())
def packed_linear(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """`_KERNELS[kernel](x)`: the engine's own GEMM (float32 panels) for one projection."""
    return _KERNELS[kernel](x.contiguous())


@packed_linear.register_fake
def _(x: torch.Tensor, kernel: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _KERNELS[kernel].out_features)


class _Layer(nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], kernels: tuple[int, ...]):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down, self.norm, self.post_norm = (
            nn.Parameter(weights[k].contiguous(), requires_grad=False)
            for k in ("qkv", "o", "gate_up", "down", "norm", "post_norm"))
        self.kernels = kernels  # the same projections' indices in _KERNELS (-1: none)


class TorchDecoder(nn.Module):
    """The decode step of a Llama-family model (no q/k norms) in plain torch ops over the
    checkpoint's dense weights; transformers' arithmetic (fp32 RMSNorm, rotate-half RoPE).
    `panels`: the projections through the engine's own GEMM kernels (`packed_linear`)."""

    cos_table: torch.Tensor  # buffers, which nn.Module's typing cannot see
    sin_table: torch.Tensor

    def __init__(self, model_dir: Path, config: ModelConfig, packed: LlamaForCausalLM,
                 panels: bool = False):
        super().__init__()
        self.panels = panels
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name).float()
        self.config = config
        self.embed = nn.Parameter(weights["model.embed_tokens.weight"], requires_grad=False)
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.head = nn.Parameter(head, requires_grad=False)
        self.final_norm = nn.Parameter(weights["model.norm.weight"], requires_grad=False)
        layers: list[_Layer] = []
        for i, packed_layer in enumerate(packed.model.layers):
            p = f"model.layers.{i}."
            attn, mlp = packed_layer.self_attn, packed_layer.mlp
            ids = []
            for kernel in (attn.qkv, attn.o, mlp.gate_up, mlp.down):
                assert kernel is not None
                _KERNELS.append(kernel)
                ids.append(len(_KERNELS) - 1)
            layers.append(_Layer({
                "qkv": torch.cat([weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
                "o": weights[p + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([weights[p + f"mlp.{x}_proj.weight"]
                                      for x in ("gate", "up")]),
                "down": weights[p + "mlp.down_proj.weight"],
                "norm": weights[p + "input_layernorm.weight"],
                "post_norm": weights[p + "post_attention_layernorm.weight"],
            }, tuple(ids)))
        self.layers = cast(list[_Layer], nn.ModuleList(layers))
        assert packed.head is not None
        _KERNELS.append(packed.head)
        self.head_kernel = len(_KERNELS) - 1
        d = config.head_dim
        inv = _inv_freq(d, config.rope_theta, config.rope_scaling)  # the engine's, scaling too
        freqs = torch.arange(8192).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return TorchKernels.rms_norm(x, w, self.config.rms_norm_eps)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, kernel: int) -> torch.Tensor:
        if self.panels:
            out: torch.Tensor = torch.ops.pdserve_bench.linear(x, kernel)
            return out
        return F.linear(x, weight)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, pool: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        n, h, hkv, d = ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos_table[positions][:, None, :]
        sin = self.sin_table[positions][:, None, :]
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.layers):
            kq, ko, kgu, kd = layer.kernels
            qkv = self._linear(self._norm(x, layer.norm), layer.qkv, kq).view(n, h + 2 * hkv, d)
            q = self._rope(qkv[:, :h], cos, sin)
            k = self._rope(qkv[:, h:h + hkv], cos, sin)
            v = qkv[:, h + hkv:]
            written = torch.ops.pdserve_bench.write_kv(pool, i, k, v, slot_blocks, slot_offsets)
            o = torch.ops.pdserve_bench.decode_attention(q, pool, i, tables, lens, d**-0.5,
                                                         written)
            x = x + self._linear(o.reshape(n, h * d), layer.o, ko)
            gate, up = self._linear(self._norm(x, layer.post_norm), layer.gate_up,
                                    kgu).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.down, kd)
        return self._linear(self._norm(x, self.final_norm), self.head, self.head_kernel)


def _inputs(engine: LLMEngine, batch: int, context: int) -> dict[str, torch.Tensor]:
    layout = engine.layout
    bs = layout.block_size
    nb = -(-(context + 1) // bs)
    tables = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb) + 1
    if int(tables.max()) >= layout.num_blocks:
        raise SystemExit("KV pool too small for --batches x --context")
    g = torch.Generator().manual_seed(batch)
    pool = engine.kv_pool
    with torch.no_grad():
        pool.copy_(torch.randn(pool.shape, generator=g) * 0.5)
    return {"ids": torch.randint(100, 40000, (batch,), generator=g),
            "positions": torch.full((batch,), context, dtype=torch.int64),
            "tables": tables, "lens": torch.full((batch,), context + 1, dtype=torch.int32),
            "slot_blocks": tables[:, context // bs].contiguous(),
            "slot_offsets": torch.full((batch,), context % bs, dtype=torch.int32)}


def _cpp_step(engine: LLMEngine, a: dict[str, torch.Tensor]) -> torch.Tensor:
    batch = a["ids"].shape[0]
    meta = AttentionMetadata(
        slot_blocks=a["slot_blocks"], slot_offsets=a["slot_offsets"], prefill_lens=[],
        prefill_starts=[], prefill_block_tables=[], num_decodes=batch,
        decode_block_tables=a["tables"], decode_context_lens=a["lens"],
        decode_mask=torch.zeros(batch, 1, 1, a["tables"].shape[1] * engine.layout.block_size))
    out: torch.Tensor = engine.runner.model(a["ids"], a["positions"], engine.kv_pool, meta,
                                            torch.arange(batch), int(a["positions"].max()))
    return out


def measure(batches: list[int], context: int, steps: int, modes: list[str]) -> dict[str, Any]:
    global _EXT
    _EXT = cpu_extension()
    if _EXT is None:
        raise SystemExit("the CPU extension did not build: nothing to compare")
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    model_dir = resolve_model(None)
    engine = LLMEngine.from_dir(model_dir, EngineConfig(kv_cache_bytes=256 << 20))
    model = engine.runner.model
    if not (isinstance(model.kernels, FusedCpuKernels) and model.has_decode_stack):
        raise SystemExit("the engine has no C++ decode loop here")
    decoders = {"": TorchDecoder(model_dir, engine.model_config, model).eval(),
                "_panels": TorchDecoder(model_dir, engine.model_config, model,
                                        panels=True).eval()}
    decoder = decoders[""]
    results: dict[str, Any] = {}
    for batch in batches:
        a = _inputs(engine, batch, context)
        pool = engine.kv_pool
        args = (a["ids"], a["positions"], pool, a["tables"], a["lens"], a["slot_blocks"],
                a["slot_offsets"])
        with torch.inference_mode():
            runs: dict[str, Any] = {"cpp_loop": lambda a=a: _cpp_step(engine, a),
                                    "eager": lambda args=args: decoder(*args)}
            compile_s: dict[str, float] = {}
            for mode, (suffix, dec) in itertools.product(modes, decoders.items()):
                torch._dynamo.reset()  # a graph each, not an earlier one from dynamo's cache
                inductor_config.cpp_wrapper = mode == CPP_WRAPPER
                fn = torch.compile(dec, dynamic=False,
                                   mode=None if mode == CPP_WRAPPER else mode)
                t = time.perf_counter()
                fn(*args)
                name = f"compiled{suffix}_{mode}"
                compile_s[name] = round(time.perf_counter() - t, 1)
                runs[name] = lambda fn=fn, args=args: fn(*args)
            inductor_config.cpp_wrapper = False
            logits = {name: fn() for name, fn in runs.items()}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(steps):
                for name, fn in runs.items():
                    t = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t) * 1e3)
        ref = logits["cpp_loop"]
        results[str(batch)] = {
            "compile_s": compile_s,
            "step_ms_p50": {n: round(statistics.median(v), 3) for n, v in times.items()},
            "step_ms_p90": {n: round(sorted(v)[int(0.9 * len(v))], 3) for n, v in times.items()},
            "max_abs_diff_vs_cpp_loop": {n: float((lg - ref).abs().max())
                                         for n, lg in logits.items() if n != "cpp_loop"},
            "argmax_equal_vs_cpp_loop": {n: bool(torch.equal(lg.argmax(-1), ref.argmax(-1)))
                                         for n, lg in logits.items() if n != "cpp_loop"},
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", default=f"default,max-autotune,{CPP_WRAPPER}",
                    help="torch.compile modes to build each graph with, each measured "
                         f"({CPP_WRAPPER}: the default mode with inductor's C++ wrapper)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    results = measure(batches, args.context, args.steps, modes)
    print(cpu_summary(), f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| batch | step | p50 ms | / C++ loop | compile s | max abs logit diff | argmax equal |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for batch, r in results.items():
        s = r["step_ms_p50"]
        for name, ms in s.items():
            diff = r["max_abs_diff_vs_cpp_loop"].get(name)
            same = r["argmax_equal_vs_cpp_loop"].get(name, "")
            print(f"| {batch} | {name} | {ms:.2f} | {ms / s['cpp_loop']:.2f}x "
                  f"| {r['compile_s'].get(name, '')} | {'' if diff is None else f'{diff:.1e}'} "
                  f"| {same} |")
    if args.out:
        args.out.write_text(json.dumps({
            "commit": commit_id(), "cpu": cpu_summary(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "context": args.context, "steps": args.steps,
            "modes": modes, "batches": results}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
