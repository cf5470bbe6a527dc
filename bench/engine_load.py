"""The engine alone under a continuous closed loop: what its scheduling and KV pool give at
a concurrency, with no server in the way (issue 20 item 3).

    python -m bench.engine_load --streams 64 --kv-mb 512,2048 [--dtypes float32] [--out FILE]

bench.serve_compare's load (200-token prompts of fresh tokens, 64 output tokens,
`ignore_eos`, C streams in a closed loop: each finished request is replaced at once), played
against `LLMEngine.step()` in this process. Each configuration (every `--kv-mb` x `--dtypes`
x `--step-targets`) runs `--rounds` times, the configurations taking turns, so a slow spell
of the machine lands on all of them. A run serves `--requests` requests; its steady window
runs from the moment the first C requests have all finished to the moment the last request
is added (the loop full all along), and the figures are the window's:

- output tokens/s, and TTFT / TPOT p50 and p90 of the requests added in it;
- where a request's first token waits: queue time (added -> first scheduled in a step) and
  prefill time (first scheduled -> first token), p50;
- preemptions and the tokens computed again because of them (prefill rows computed - prompt
  tokens sent: a preempted stream's prompt and output so far are computed anew), the steps,
  and the share of step time spent on prefill rows (from a least-squares fit of step time
  over prefill rows and decode rows).

If the server's figures (bench.serve_compare) match these, the serving path is not what
sets them. Prints a table with the CPU flags; `--out` writes the runs as JSON with the commit.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import commit_id
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.types import GenerateRequest, SamplingParams


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def closed_loop(engine: LLMEngine, streams: int, requests: int, prompt: int, output: int,
                seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    steps: list[tuple[int, int, float]] = []  # (prefill tokens, decode rows, seconds)
    scheduled: dict[str, float] = {}
    run = engine.runner.run

    def timed_run(out: SchedulerOutput) -> Any:
        now = time.perf_counter()
        for s in out.scheduled:
            scheduled.setdefault(s.seq.request_id, now)
        rows = [s.num_new_tokens for s in out.scheduled if s.start < s.seq.num_prompt_tokens]
        result = run(out)
        steps.append((sum(rows), len(out.scheduled) - len(rows), time.perf_counter() - now))
        return result

    engine.runner.run = timed_run  # type: ignore[method-assign]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    emitted: list[float] = []  # the time of every output token
    preempted_before = engine.num_preemptions
    names = (f"s{seed}-{i}" for i in itertools.count())

    def add() -> None:
        rid = next(names)
        engine.add_request(GenerateRequest(
            rid, tuple(rng.randrange(1000, 40000) for _ in range(prompt)),
            SamplingParams(max_tokens=output, ignore_eos=True)))
        added[rid] = time.perf_counter()

    try:
        for _ in range(streams):
            add()
        full_from = last_add = 0.0
        while engine.has_unfinished():
            events = engine.step()
            now = time.perf_counter()
            for ev in events:
                if ev.token_id is not None:
                    first.setdefault(ev.request_id, now)
                    emitted.append(now)
                if ev.finish_reason is not None:
                    last[ev.request_id] = now
                    if len(last) == streams:
                        full_from = now
                    if len(added) < requests:
                        add()
                        last_add = now
    finally:
        engine.runner.run = run  # type: ignore[method-assign]
    if last_add <= full_from:
        raise ValueError(f"{requests} requests for {streams} streams leave no window with the "
                         "loop full: raise --requests")
    window = [r for r, t in added.items() if full_from <= t <= last_add]
    tokens = sum(1 for t in emitted if full_from <= t <= last_add)
    ttft = [first[r] - added[r] for r in window]
    tpot = [(last[r] - first[r]) / (output - 1) for r in window]
    queue = [scheduled[r] - added[r] for r in window]
    prefill = [first[r] - scheduled[r] for r in window]
    a = np.array(steps[streams:] or steps)  # past the first wave's prefill
    fit, *_ = np.linalg.lstsq(np.c_[np.ones(len(a)), a[:, 0], a[:, 1]], a[:, 2], rcond=None)
    prefill_share = float(fit[1] * a[:, 0].sum() / a[:, 2].sum())
    return {
        "window_s": last_add - full_from, "requests_in_window": len(window),
        "out_tok_s": tokens / (last_add - full_from),
        "ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p90_ms": _pct(ttft, 90) * 1e3,
        "tpot_p50_ms": _pct(tpot, 50) * 1e3, "tpot_p90_ms": _pct(tpot, 90) * 1e3,
        "queue_p50_ms": _pct(queue, 50) * 1e3, "prefill_p50_ms": _pct(prefill, 50) * 1e3,
        "preemptions": engine.num_preemptions - preempted_before,
        "tokens_recomputed": int(sum(s[0] for s in steps)) - prompt * len(added),
        "steps": len(steps), "step_p50_ms": statistics.median(s[2] for s in steps) * 1e3,
        "fit_ms": {"step": fit[0] * 1e3, "per_prefill_token": fit[1] * 1e3,
                   "per_decode_row": fit[2] * 1e3},
        "prefill_share_of_step_time": prefill_share,
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=0,
                   help="requests a run serves (default: 4 x streams)")
    p.add_argument("--kv-mb", default="2048", help="KV pool sizes in MiB, comma-separated")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--step-targets", default=str(EngineConfig().step_target_ms),
                   help="--step-target-ms values, comma-separated")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    requests = args.requests or 4 * args.streams
    if requests < 3 * args.streams:
        p.error("--requests must be at least 3 x --streams (a window with the loop full)")
    model = resolve_model(None)
    configs = [(int(kv), dt, float(st)) for kv in args.kv_mb.split(",")
               for dt in args.dtypes.split(",") for st in args.step_targets.split(",")]
    print(cpu_summary(), flush=True)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for kv, dtype, target in configs:
            engine = LLMEngine.from_dir(model, EngineConfig(
                kv_cache_bytes=kv << 20, dtype=dtype, step_target_ms=target,
                num_threads=args.threads, enable_prefix_caching=False))
            engine.add_request(GenerateRequest(  # warm the kernels
                "warm", tuple(range(1000, 1000 + args.prompt)), SamplingParams(max_tokens=8)))
            while engine.has_unfinished():
                engine.step()
            row = {"kv_mb": kv, "dtype": dtype, "step_target_ms": target, "round": rnd,
                   **closed_loop(engine, args.streams, requests, args.prompt, args.output,
                                 seed=rnd)}
            runs.append(row)
            del engine
            print(f"kv {kv:5d} MiB {dtype:8s} target {target:4.0f} ms round {rnd}: "
                  f"{row['out_tok_s']:6.1f} out tok/s, TTFT p50 {row['ttft_p50_ms']:6.0f} ms "
                  f"(queue {row['queue_p50_ms']:5.0f} + prefill {row['prefill_p50_ms']:5.0f}), "
                  f"TPOT p50 {row['tpot_p50_ms']:4.0f} ms, {row['preemptions']} preemptions, "
                  f"{row['tokens_recomputed']} tokens recomputed, prefill "
                  f"{row['prefill_share_of_step_time']:.0%} of step time", flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python -m bench.engine_load " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                if k != "out" and v is not None),
            "commit": commit_id(), "cpu": cpu_summary(), "streams": args.streams,
            "requests": requests, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
