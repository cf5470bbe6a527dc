"""The per-step token budget against a burst of prompts, on the engine alone (issue 20 item 3).

    python -m bench.budget_curve [--budgets 512,1024,2048,4096] [--out FILE]

A closed loop of K streams with equal prompts and outputs (bench.serve_compare at c=16:
200-token prompts, 64 output tokens, `ignore_eos`) arrives in waves: all K start together,
finish together, and the next K start together. So the time to first token is set by how the
engine prefills K prompts at once, which `max_num_batched_tokens` (the token budget of one
step: prefill chunks + decode rows) shapes: a small budget gives the first prompts their
token early but runs more, less efficient steps; a large one makes every prompt wait for
the whole burst. For each budget this builds the engine (float32, `--threads`), runs
`--waves` waves of `--streams` prompts (the first is a warm-up) and reports the best
wave's TTFT p50 / max, its length and the output tokens per second. Prints the rows with
the CPU flags; `--out` writes them as JSON with the commit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams


def wave(engine: LLMEngine, tag: str, streams: int, prompt: int, output: int,
         rng: random.Random) -> dict[str, float]:
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(streams):
        ids = tuple(rng.randrange(1000, 40000) for _ in range(prompt))
        engine.add_request(GenerateRequest(f"{tag}-{i}", ids,
                                           SamplingParams(max_tokens=output, ignore_eos=True)))
    steps = 0
    while engine.has_unfinished():
        for ev in engine.step():
            first.setdefault(ev.request_id, time.perf_counter() - start)
        steps += 1
    total = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1], "wave_s": total,
            "out_tok_s": streams * output / total, "steps": steps}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.budget_curve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", default="512,1024,2048,4096")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = resolve_model(None)
    rows = []
    print(cpu_summary())
    for budget in (int(b) for b in args.budgets.split(",")):
        engine = LLMEngine.from_dir(model, EngineConfig(
            num_threads=args.threads, enable_prefix_caching=False,
            max_num_batched_tokens=budget, max_prefill_chunk=min(512, budget),
            step_target_ms=0.0))  # the token budget alone: what this measures
        rng = random.Random(0)
        runs = [wave(engine, f"w{w}", args.streams, args.prompt, args.output, rng)
                for w in range(args.waves)]
        best = min(runs[1:] or runs, key=lambda r: r["wave_s"])
        rows.append({"max_num_batched_tokens": budget, **best})
        print(f"budget {budget:5d}: TTFT p50 {best['ttft_p50_s'] * 1e3:6.0f} ms, max "
              f"{best['ttft_max_s'] * 1e3:6.0f} ms; wave {best['wave_s']:.2f} s, "
              f"{best['out_tok_s']:.1f} out tok/s, {best['steps']} steps", flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
        args.out.write_text(json.dumps({
            "command": "python -m bench.budget_curve " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k != "out"),
            "commit": commit, "cpu": cpu_summary(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
