"""Where one engine step's time goes, beside its rooflines, measured in one run.

    python -m bench.profile_step --dtypes float32,int8 --batches 1,16 --context 200

For each dtype and decode batch: the median engine step (scheduler, model, sampler) and,
with the same shapes, each part on its own: the linear layers (every projection and the LM
head), attention (KV write + paged decode attention), norms/RoPE/activation, sampling. What
remains of the step is not all Python: inside a step the parts take longer than apart (other
data in the caches). So a second table times the same parts inside real decode steps, each
call wrapped in a clock, and what is left between the calls: Python, step metadata, the
scheduler (plus ~1 us a wrapped call). Rooflines beside it: the weight-read bound
(weight bytes / the read bandwidth measured here) and the bare GEMM time of the same shapes.
Also one `--prefill`-token prompt (prompt tokens / s). `--prefill-ab ROUNDS`: only that
prompt, the dtypes taking turns round by round (an interleaved A/B of prefill speed).

`--against REV`: float32 activations' fused kernels (norms, RoPE, KV write, decode attention)
also from REV's kernels/cpu_ops.cpp (with its prefetch on, REV's default), the decode steps
alternating between the two step by step on the same sequences: a before/after in one run.
`--against-python-loop`: the same alternation between the model's C++ layer loop
(cpu_ops.cpp's DecodeStack) and its Python layer loop over the same kernels. The parts inside
a step are timed with the Python loop (the C++ one makes the same calls out of the clocks'
reach).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench import build_at, commit_id
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cpu import DISABLE_AMX_ENV, cpu_summary
from pdserve.engine.kernels import FusedCpuKernels
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.kv_layout import KVLayout
from pdserve.types import GenerateRequest, SamplingParams


@dataclass(frozen=True)
class _Row:
    """What the sampler reads of a request (engine.sampler.SampleRow)."""

    sampling: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]


def best_ms(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def read_bandwidth_gbs(nbytes: int = 512 << 20) -> float:
    """All threads summing a buffer larger than any cache: what a weight read can reach."""
    buf = torch.ones(nbytes // 4)
    return nbytes / best_ms(buf.sum) / 1e6


def _decode_steps(engine: LLMEngine, rng: random.Random, batch: int, context: int,
                  steps: int, alternate: Callable[[bool], object] | None = None,
                  on_decode: Callable[[], object] | None = None) -> list[float]:
    """The decode steps' times (ms). With ``alternate``, called with True before each odd
    step and False before each even one (and at the end), odd steps run the other way: even
    steps' times first, then odd ones'.
    ``on_decode`` is called once, when the prompts are in and decoding starts."""
    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for _ in range(batch):
        ids = tuple(rng.randrange(100, 40000) for _ in range(context))
        engine.add_request(GenerateRequest(f"p{rng.random()}", ids, sp))
    sched = engine.scheduler
    while sched.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                   for s in sched.running):
        engine.step()
    if len(sched.running) != batch:
        raise SystemExit(f"only {len(sched.running)} of {batch} sequences run at once: the "
                         "KV pool is too small, or --steps too few to outlast the batch's "
                         "prefill")
    if on_decode is not None:
        on_decode()
    times: tuple[list[float], list[float]] = ([], [])
    try:
        while engine.has_unfinished():
            odd = alternate is not None and len(times[0]) > len(times[1])
            if alternate is not None:
                alternate(odd)
            t = time.perf_counter()
            engine.step()
            times[odd].append((time.perf_counter() - t) * 1e3)
    finally:
        if alternate is not None:
            alternate(False)
    if alternate is None:
        return times[0][:-1]  # the last step only finishes requests
    n = min(len(times[0]), len(times[1])) - 1
    return times[0][:n] + times[1][:n]


@torch.inference_mode()
def parts_ms(engine: LLMEngine, batch: int, context: int) -> dict[str, float]:
    model, layout = engine.runner.model, engine.layout
    cfg = engine.model_config
    kernels = model.kernels
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = engine.kv_pool.dtype  # the activations' dtype (bfloat16 weights take bf16 rows)
    x = torch.randn(batch, cfg.hidden_size, dtype=dt)
    xi = torch.randn(batch, cfg.intermediate_size, dtype=dt)
    layers = model.model.layers
    calls = [(k, xi if k is layer.mlp.down else x) for layer in layers
             for k in (layer.self_attn.qkv, layer.self_attn.o, layer.mlp.gate_up,
                       layer.mlp.down) if k is not None]
    assert model.head is not None, "a packed model"
    calls.append((model.head, x))
    gemm = best_ms(lambda: [k(a) for k, a in calls])
    nb = -(-(context + 1) // layout.block_size)
    tables = torch.arange(batch * nb).view(batch, nb) % layout.num_blocks
    lens = torch.full((batch,), context + 1)
    span = torch.arange(nb * layout.block_size)
    mask = torch.zeros(batch, 1, 1, nb * layout.block_size, dtype=dt).masked_fill(
        (span[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    qkv = torch.randn(batch, h + 2 * hkv, d, dtype=dt)
    slots = tables[:, -1], torch.full((batch,), context % layout.block_size)
    pool = engine.kv_pool

    def attention() -> None:
        for i in range(len(layers)):
            kv = pool[:, i]
            kernels.write_kv(kv, qkv[:, h:h + hkv], qkv[:, h + hkv:], *slots)
            kernels.decode_attention(qkv[:, :h], kv, tables, lens, mask, d**-0.5)

    cos, sin = torch.randn(batch, d, dtype=dt), torch.randn(batch, d, dtype=dt)
    w = torch.ones(cfg.hidden_size, dtype=dt)
    gu = torch.randn(batch, 2 * cfg.intermediate_size, dtype=dt)

    def elementwise() -> None:
        for _ in layers:
            kernels.add_rms_norm_(x, x, w, 1e-5)
            kernels.rope_(qkv, h + hkv, cos, sin)
            kernels.add_rms_norm_(x, x, w, 1e-5)
            kernels.silu_mul(gu)

    logits = torch.randn(batch, cfg.vocab_size)
    rows = [_Row(SamplingParams(), (1,), ()) for _ in range(batch)]
    return {"linear": gemm, "attention": best_ms(attention), "norm/rope/act":
            best_ms(elementwise), "sampling": best_ms(
                lambda: engine.sampler.sample(logits, rows))}


class _Clock:
    """Wall time and calls of wrapped functions, by part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t
                self.calls[part] = self.calls.get(part, 0) + 1

        return timed


_KERNEL_PARTS = {"write_kv": "attention", "decode_attention": "attention",
                 "rms_norm": "norm/rope/act", "add_rms_norm_": "norm/rope/act",
                 "rope_": "norm/rope/act", "silu_mul": "norm/rope/act"}


def in_step_ms(engine: LLMEngine, rng: random.Random, batch: int, context: int,
               steps: int) -> dict[str, float]:
    """The same parts, timed inside real decode steps: every kernel call, linear and the
    sampler wrapped in a clock (about 1 us a call, ~250 calls a step), and what is left of the
    step between those calls (Python, metadata, the scheduler). Means per step, ms."""
    model, clock = engine.runner.model, _Clock()
    kernels = model.kernels
    model.decode_stack_on = False  # the Python loop, whose calls the clocks see
    linears: list[tuple[object, str]] = [(owner, name) for layer in model.model.layers
               for owner, name in ((layer.self_attn, "qkv"), (layer.self_attn, "o"),
                                   (layer.mlp, "gate_up"), (layer.mlp, "down"))]
    linears.append((model, "head"))
    saved = [(owner, name, getattr(owner, name)) for owner, name in linears]
    try:  # instance attributes: they shadow the methods until deleted
        for name, part in _KERNEL_PARTS.items():
            vars(kernels)[name] = clock.wrap(part, getattr(kernels, name))
        for owner, name, kernel in saved:
            object.__setattr__(owner, name, clock.wrap("linear", kernel))
        vars(engine.sampler)["sample"] = clock.wrap("sampling", engine.sampler.sample)
        vars(engine)["step"] = clock.wrap("step", engine.step)
        _decode_steps(engine, rng, batch, context, steps, on_decode=clock.clear)
    finally:
        for name in (*_KERNEL_PARTS, "sample", "step"):
            for obj in (kernels, engine.sampler, engine):
                vars(obj).pop(name, None)
        for owner, name, kernel in saved:
            object.__setattr__(owner, name, kernel)
        model.decode_stack_on = True
    n = clock.calls["step"]
    out = {part: 1e3 * clock.seconds.get(part, 0.0) / n
           for part in ("linear", "attention", "norm/rope/act", "sampling")}
    out["between_calls"] = 1e3 * clock.seconds["step"] / n - sum(out.values())
    out["step_mean"] = 1e3 * clock.seconds["step"] / n
    return out


def _switch(obj: object, attr: str, even: object, odd: object) -> Callable[[bool], object]:
    """For `_decode_steps`' ``alternate``: ``obj.attr`` set to ``odd`` or ``even``."""
    return lambda is_odd: setattr(obj, attr, odd if is_odd else even)


def _prefill(engine: LLMEngine, rng: random.Random, n: int) -> None:
    ids = tuple(rng.randrange(100, 40000) for _ in range(n))
    engine.add_request(GenerateRequest(f"f{rng.random()}", ids, SamplingParams(max_tokens=1)))
    while engine.has_unfinished():
        engine.step()


# A --prefill-ab entry "DTYPE:VARIANT" builds that dtype's engine with this environment.
_VARIANT_ENV = {"noamx": {DISABLE_AMX_ENV: "1"}}


def _load_variant(model_dir: Path, name: str, threads: int | None) -> LLMEngine:
    dtype, _, variant = name.partition(":")
    if variant and variant not in _VARIANT_ENV:
        raise SystemExit(f"{name}: the variants are {sorted(_VARIANT_ENV)}")
    with mock.patch.dict(os.environ, _VARIANT_ENV.get(variant, {})):  # read while loading
        return LLMEngine.from_dir(model_dir, EngineConfig(
            dtype=dtype, kv_cache_bytes=256 << 20, enable_prefix_caching=False,
            num_threads=threads, step_target_ms=0.0))


def prefill_ab(model_dir: Path, dtypes: list[str], tokens: int, rounds: int,
               threads: int | None) -> dict[str, list[float]]:
    """One `tokens`-token prompt per dtype per round, the dtypes taking turns on the same
    prompt each round (every engine built first), so a slow spell of the machine lands on all
    of them: prompt tokens / s per dtype and round. A dtype may name a variant, e.g.
    ``int8:noamx`` (int8 with PDSERVE_DISABLE_AMX=1)."""
    engines = {d: _load_variant(model_dir, d, threads) for d in dtypes}
    rng = random.Random(0)
    for e in engines.values():
        _prefill(e, rng, tokens)  # warm
    rates: dict[str, list[float]] = {d: [] for d in dtypes}
    for _ in range(rounds):
        seed = rng.random()
        for d, e in engines.items():
            start = time.perf_counter()
            _prefill(e, random.Random(seed), tokens)
            rates[d].append(tokens / (time.perf_counter() - start))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens to time a "
                    "prefill with (0: none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the rows as a JSON record here")
    ap.add_argument("--against", metavar="REV", help="alternate steps with REV's fused "
                    "kernels (float32 activations)")
    ap.add_argument("--against-python-loop", action="store_true", help="alternate steps "
                    "with the Python layer loop (where the C++ layer loop runs)")
    ap.add_argument("--prefill-ab", type=int, default=0, metavar="ROUNDS",
                    help="instead: only the --prefill-token prompt, the dtypes taking turns "
                    "for ROUNDS rounds (an interleaved A/B of prefill); a dtype may be "
                    "DTYPE:noamx (that dtype with PDSERVE_DISABLE_AMX=1)")
    ap.add_argument("--prefill-lens", default=None, metavar="N,...",
                    help="with --prefill-ab: each of these prompt lengths in turn")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefill_ab:
        dtypes = args.dtypes.split(",")
        lengths = [int(t) for t in (args.prefill_lens or str(args.prefill)).split(",")]
        print(f"CPU: {cpu_summary()}; torch threads {torch.get_num_threads()}; "
              f"{args.prefill_ab} rounds, dtypes in turn")
        runs = []
        for tokens in lengths:
            rates = prefill_ab(resolve_model(args.model), dtypes, tokens, args.prefill_ab,
                               args.threads)
            med = {d: statistics.median(r) for d, r in rates.items()}
            print(f"prompt {tokens} tokens")
            for d in dtypes:
                wins = sum(a > b for a, b in zip(rates[d], rates[dtypes[0]], strict=True))
                print(f"  {d:12s} p50 {med[d]:7.0f} tok/s  min {min(rates[d]):7.0f}  max "
                      f"{max(rates[d]):7.0f}  / {dtypes[0]} {med[d] / med[dtypes[0]]:.3f}x  "
                      f"(faster in {wins} of {args.prefill_ab} rounds)")
            runs.append({"prefill_tokens": tokens, "tok_per_s": rates, "p50_tok_per_s": med})
        if args.out:
            Path(args.out).write_text(json.dumps({
                "benchmark": "bench.profile_step --prefill-ab", "commit": commit_id(),
                "argv": sys.argv[1:], "cpu": cpu_summary(), "threads": torch.get_num_threads(),
                "load_avg": os.getloadavg(), "runs": runs}, indent=1) + "\n")
        return
    bw = read_bandwidth_gbs()
    print(f"CPU: {cpu_summary()}; torch threads {torch.get_num_threads()}; "
          f"read bandwidth {bw:.1f} GB/s")
    print("\n| dtype | batch | step p50 ms | linear | attention | norm/rope/act | sampling | "
          "rest (step - parts apart) | weight-read bound | step / bound | step / bare GEMMs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(0)
    prefill = {}
    rows = []
    inside: dict[tuple[str, int], dict[str, float]] = {}
    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    # A pool that holds every sequence of the largest batch at its longest (fp32 KV, the
    # widest), so each step decodes the whole batch: a smaller pool would preempt some.
    kv_token_bytes = KVLayout(1, cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, "float32",
                              "").block_nbytes
    longest = args.context + args.steps + 64
    kv_bytes = max(512 << 20, int(1.2 * max(int(b) for b in args.batches.split(","))
                                  * longest * kv_token_bytes))
    for dtype in args.dtypes.split(","):
        engine = LLMEngine.from_dir(model_dir, EngineConfig(
            dtype=dtype, kv_cache_bytes=kv_bytes, enable_prefix_caching=False,
            num_threads=args.threads, step_target_ms=0.0))  # a prompt in whole chunks
        bound = engine.runner.model.weight_nbytes() / bw / 1e6
        model = engine.runner.model
        alternate: Callable[[bool], object] | None = None
        against_name = ""
        if args.against and isinstance(model.kernels, FusedCpuKernels):
            own, theirs = model.kernels, FusedCpuKernels(build_at(args.against), prefetch=True)
            alternate = _switch(model, "kernels", own, theirs)
            against_name = f"{args.against}'s fused kernels"
        elif args.against_python_loop and model.has_decode_stack:
            alternate = _switch(model, "decode_stack_on", True, False)
            against_name = "the Python layer loop"
        for batch in (int(b) for b in args.batches.split(",")):
            both = _decode_steps(engine, rng, batch, args.context, args.steps, alternate)
            against = None
            if alternate is not None:
                against = statistics.median(both[len(both) // 2:])
                both = both[: len(both) // 2]
            step = statistics.median(both)
            parts = parts_ms(engine, batch, args.context)
            rest = step - sum(parts.values())
            inside[(dtype, batch)] = in_step_ms(engine, rng, batch, args.context, args.steps)
            rows.append({"dtype": dtype, "batch": batch, "step_p50_ms": step, **{
                f"{k}_ms": v for k, v in parts.items()}, "python_dispatch_ms": rest,
                "weight_read_bound_ms": bound, "in_step_ms": inside[(dtype, batch)]} | (
                    {} if against is None else {
                    "against_step_p50_ms": against, "step_over_against": step / against}))
            print(f"| {dtype} | {batch} | {step:.1f} | " + " | ".join(
                f"{v:.1f}" for v in parts.values()) + f" | {rest:.1f} | {bound:.1f} | "
                f"{step / bound:.2f}x | {step / parts['linear']:.2f}x |")
            if against is not None:
                print(f"|   | (the steps between, {against_name}: "
                      f"{against:.1f} ms; above / this {step / against:.3f}) |")
        if args.prefill > 0:
            prefill[dtype] = args.prefill / best_ms(
                functools.partial(_prefill, engine, rng, args.prefill), 3) * 1e3
        del engine
    print("\nThe same parts timed inside real decode steps (each call wrapped in a clock), "
          "means per step, ms:\n")
    print("| dtype | batch | step (wrapped) | linear | attention | norm/rope/act | sampling | "
          "between the calls |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (dtype, batch), p in inside.items():
        print(f"| {dtype} | {batch} | {p['step_mean']:.1f} | {p['linear']:.1f} | "
              f"{p['attention']:.1f} | {p['norm/rope/act']:.1f} | {p['sampling']:.1f} | "
              f"{p['between_calls']:.1f} |")
    if prefill:
        print("\n" + "; ".join(f"prefill {args.prefill} tokens, {k}: {v:.0f} tok/s"
                               for k, v in prefill.items()))
    if args.out:
        record = {"benchmark": "bench.profile_step", "commit": commit_id(), "argv": sys.argv[1:],
                  "cpu": cpu_summary(), "threads": torch.get_num_threads(),
                  "read_bandwidth_gbs": bw, "against": args.against,
                  "against_python_loop": args.against_python_loop,
                  "load_avg": os.getloadavg(), "rows": rows,
                  "prefill_tok_per_s": prefill}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
