"""What a weight format costs in output quality, measured against float32 on the same model.

    python -m bench.quality --dtypes int8 --prompts 50 --tokens 64

For each dtype, on the same prompts (windows of a fixed text shipped in tests/data):

- **greedy agreement**: each prompt generates `--tokens` greedy tokens in float32 and in the
  dtype; reported: sequences identical to the end, the mean length of the common prefix, and
  teacher-forced top-1 agreement (the dtype's argmax at every position of the float32
  continuation equals float32's, so one early divergence does not hide the rest);
- **perplexity** of the whole text (chunks of `--ppl-window` tokens, no overlap).

Used by tests/test_quantized.py with small sizes; the numbers are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import commit_id
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import DISABLE_AMX_ENV, cpu_summary
from pdserve.engine.kernels import quant
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "eval_text.md"


@dataclass(frozen=True)
class Quality:
    dtype: str
    prompts: int
    tokens: int
    identical_sequences: float  # fraction of prompts whose whole continuation matches float32
    mean_common_prefix: float  # tokens, out of `tokens`
    teacher_forced_top1: float  # fraction of positions with the same argmax as float32
    perplexity: float


def eval_prompts(token_ids: Sequence[int], n: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of 24-96 tokens of the text, at seeded positions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(24, 96)
        start = rng.randrange(0, len(token_ids) - length)
        out.append(list(token_ids[start:start + length]))
    return out


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"q{i}", tuple(p), sp))
    out: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
    return [out[f"q{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def all_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one fresh sequence, straight through the model."""
    model, layout = engine.runner.model, engine.layout
    bs, n = layout.block_size, len(ids)
    nb = -(-n // bs)
    assert nb <= layout.num_blocks
    pos = torch.arange(n)
    meta = AttentionMetadata(
        slot_blocks=pos // bs, slot_offsets=pos % bs, prefill_lens=[n], prefill_starts=[0],
        prefill_block_tables=[torch.arange(nb)], num_decodes=0, decode_block_tables=None,
        decode_context_lens=None, decode_mask=None)
    return model(torch.tensor(ids), pos, engine.kv_pool, meta, pos)


def perplexity(engine: LLMEngine, token_ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        logp = torch.log_softmax(all_logits(engine, chunk[:-1]), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp.gather(1, target[:, None]).sum())
        count += len(target)
    return math.exp(nll / count)


def measure(model_dir: Path, dtypes: Sequence[str], n_prompts: int, tokens: int,
            ppl_window: int = 256, threads: int | None = None) -> list[Quality]:
    def engine(dtype: str) -> LLMEngine:
        return LLMEngine.from_dir(model_dir, EngineConfig(
            dtype=dtype, kv_cache_bytes=256 << 20, enable_prefix_caching=False,
            num_threads=threads))

    ref = engine("float32")
    assert ref.tokenizer is not None
    text_ids = ref.tokenizer.encode(TEXT.read_text())
    prompts = eval_prompts(text_ids, n_prompts)
    ref_out = greedy(ref, prompts, tokens)
    results = [Quality("float32", n_prompts, tokens, 1.0, float(tokens), 1.0,
                       perplexity(ref, text_ids, ppl_window))]
    ref_argmax = [all_logits(ref, p + o[:-1])[len(p) - 1:].argmax(-1) for p, o in
                  zip(prompts, ref_out, strict=True)]
    del ref
    for dtype in dtypes:
        eng = engine(dtype)
        out = greedy(eng, prompts, tokens)
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), tokens)
                  for x, y in zip(out, ref_out, strict=True)]
        agree = [float((all_logits(eng, p + o[:-1])[len(p) - 1:].argmax(-1) == ra).float().mean())
                 for p, o, ra in zip(prompts, ref_out, ref_argmax, strict=True)]
        results.append(Quality(
            dtype, n_prompts, tokens,
            identical_sequences=sum(p == tokens for p in prefix) / n_prompts,
            mean_common_prefix=sum(prefix) / n_prompts,
            teacher_forced_top1=sum(agree) / n_prompts,
            perplexity=perplexity(eng, text_ids, ppl_window)))
        del eng
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="int8", help="comma-separated, compared to float32")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ppl-window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    results = measure(resolve_model(args.model), [d for d in args.dtypes.split(",") if d],
                      args.prompts, args.tokens, args.ppl_window, args.threads)
    print(f"CPU: {cpu_summary()}")
    print(f"{args.prompts} prompts x {args.tokens} greedy tokens; perplexity over "
          f"{TEXT.name}\n")
    print("| dtype | identical sequences | mean common prefix | teacher-forced top-1 | "
          "perplexity |")
    print("|---|---:|---:|---:|---:|")
    for q in results:
        print(f"| {q.dtype} | {q.identical_sequences:.0%} | {q.mean_common_prefix:.1f} / "
              f"{q.tokens} | {q.teacher_forced_top1:.1%} | {q.perplexity:.3f} |")
    if args.out:
        # The switches that pick kernels, as this run had them (unset: the CPU's own choice).
        env = {k: os.environ.get(k) for k in (DISABLE_AMX_ENV, quant.ISA_ENV)}
        args.out.write_text(json.dumps({
            "benchmark": "bench.quality", "commit": commit_id(), "argv": sys.argv[1:],
            "cpu": cpu_summary(), "environment": env,
            "results": [asdict(q) for q in results]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
