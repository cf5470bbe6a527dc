"""The engine next to Hugging Face transformers `generate`, same model, same threads.

    python bench/bench_engine.py [--concurrency 1,8,32] [--threads N] [--quick]

Measures, for the default model (SmolLM2-135M-Instruct, float32, CPU):

- decode: output tokens/s for N concurrent 128-token prompts that each generate exactly 128
  tokens (transformers: one batched `generate`, left padded, EOS suppressed with
  min_new_tokens; ours: N requests submitted at once, ignore_eos). Wall time includes prefill.
- prefill: prompt tokens/s for one 512- and one 2,048-token prompt with max_tokens=1.
- peak RSS of each side.

Each side runs in its own child process (so peak RSS and thread settings are its own) and
prints JSON; repetitions alternate the sides and keep each metric's best. This process prints
a markdown table with the ratio ours / transformers. Prompts are random token ids, fresh for
every measurement, so the prefix cache never helps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN = 128
OUTPUT_LEN = 128
PREFILL_LENS = (512, 2048)
# Skip the lowest ids: SmolLM2's special tokens live there.
MIN_TOKEN_ID = 1000


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(MIN_TOKEN_ID, vocab, (n, length), generator=g).tolist()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- one side


class _Ours:
    def __init__(self, model_dir: Path, threads: int, max_batch: int):
        from engine.config import EngineConfig, ModelConfig
        from engine.llm_engine import LLMEngine
        from engine.model_runner import kv_block_nbytes

        # A pool just big enough for the largest batch: the KV cache is part of peak RSS.
        tokens = max(max_batch * (PROMPT_LEN + OUTPUT_LEN), max(PREFILL_LENS)) + 256
        config = EngineConfig(num_threads=threads, max_num_seqs=max(max_batch, 1))
        block_bytes = kv_block_nbytes(ModelConfig.from_dir(model_dir), config)
        config = EngineConfig(num_threads=threads, max_num_seqs=max(max_batch, 1),
                              kv_cache_bytes=block_bytes * (tokens // config.block_size + 1))
        self.engine = LLMEngine.from_dir(model_dir, config)
        self.vocab = self.engine.model_config.vocab_size
        self._n = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        from engine.types import GenerateRequest, SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for p in prompts:
            self._n += 1
            self.engine.add_request(GenerateRequest(f"b{self._n}", tuple(p), sp))
        out = 0
        while self.engine.has_unfinished():
            out += sum(e.token_id is not None for e in self.engine.step())
        return time.perf_counter() - t0, out


class _Transformers:
    def __init__(self, model_dir: Path, threads: int, max_batch: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          local_files_only=True).eval()
        self.vocab = self.model.config.vocab_size
        self.pad = self.model.generation_config.pad_token_id or 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        import torch

        width = max(len(p) for p in prompts)
        # Left padding, as batched generation needs (all prompts here have the same length).
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                    min_new_tokens=max_tokens, do_sample=False,
                                    pad_token_id=self.pad)
        return time.perf_counter() - t0, (y.shape[1] - width) * y.shape[0]


def run_side(side: str, model_dir: Path, concurrency: list[int], threads: int,
             seed: int) -> dict[str, Any]:
    cls = _Ours if side == "ours" else _Transformers
    runner = cls(model_dir, threads, max(concurrency))
    seed *= 1000

    def fresh(n: int, length: int) -> list[list[int]]:
        nonlocal seed
        seed += 1
        return _prompts(runner.vocab, n, length, seed)

    runner.run(fresh(2, 64), 4)  # warm-up: first-call allocations, lazy init
    results: dict[str, Any] = {"decode": {}, "prefill": {}}
    for n in concurrency:
        dt, out = runner.run(fresh(n, PROMPT_LEN), OUTPUT_LEN)
        assert out == n * OUTPUT_LEN, (side, n, out)
        results["decode"][str(n)] = out / dt
    for length in PREFILL_LENS:
        dt, _ = runner.run(fresh(1, length), 1)
        results["prefill"][str(length)] = length / dt
    results["peak_rss_mb"] = _peak_rss_mb()
    return results


# --------------------------------------------------------------------------- driver


def _child(side: str, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--side", side, "--concurrency", args.concurrency,
           "--threads", str(args.threads), "--rep", str(rep)]
    proc = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best throughput per metric over the repetitions (noise on a shared machine only ever
    slows a run down); peak RSS is the largest seen."""
    best: dict[str, Any] = {k: {m: max(r[k][m] for r in runs) for m in runs[0][k]}
                            for k in ("decode", "prefill")}
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return best


def _table(ours: dict[str, Any], hf: dict[str, Any], concurrency: list[int]) -> str:
    rows = ["| metric | ours | transformers | ours / transformers |", "|---|---:|---:|---:|"]

    def row(name: str, a: float, b: float, unit: str) -> None:
        rows.append(f"| {name} | {a:,.0f} {unit} | {b:,.0f} {unit} | {a / b:.2f}x |")

    for n in concurrency:
        row(f"decode, concurrency {n} ({PROMPT_LEN} in / {OUTPUT_LEN} out)",
            ours["decode"][str(n)], hf["decode"][str(n)], "tok/s")
    for length in PREFILL_LENS:
        row(f"prefill, {length:,}-token prompt", ours["prefill"][str(length)],
            hf["prefill"][str(length)], "tok/s")
    row("peak RSS", ours["peak_rss_mb"], hf["peak_rss_mb"], "MB")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch intra-op threads for both sides (default: all cores)")
    p.add_argument("--quick", action="store_true", help="one repetition instead of best of 2")
    p.add_argument("--side", choices=("ours", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from engine.model_store import pull_default_model

    model_dir = pull_default_model(progress=False)
    if args.side:
        print(json.dumps(run_side(args.side, model_dir, concurrency, args.threads, args.rep)))
        return

    import torch
    import transformers

    reps = 1 if args.quick else 2
    t0 = time.perf_counter()
    hf_runs, our_runs = [], []
    for rep in range(reps):  # alternate the sides, so a burst of outside load hits both
        hf_runs.append(_child("hf", args, rep))
        our_runs.append(_child("ours", args, rep))
    print(f"model: {model_dir.name} (float32), threads: {args.threads}, "
          f"cpus: {os.cpu_count()}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"repetitions: {reps} (best kept), wall time {time.perf_counter() - t0:.0f} s\n")
    print(_table(_best(our_runs), _best(hf_runs), concurrency))


if __name__ == "__main__":
    main()
