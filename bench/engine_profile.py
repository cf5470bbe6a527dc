"""Step-cost profile of the engine on this machine, for the cluster simulator (bench.cluster_sim).

    taskset -c 1 python -m bench.engine_profile --threads 1 \\
        --out docs/bench/cluster_sim/engine_profile.json

Steps a real `LLMEngine` (the one both worker kinds run) through decode-only batches, lone
prompts (chunked, with and without a cached prefix) and prompts arriving into a running batch,
times every `engine.step()` and records what that step computed: per scheduled sequence its
new tokens and the context before them. A least-squares fit (weighted for relative error) of

    step_s = D(decode_rows) + c_tok * prefill_tokens + c_pair * prefill_pairs
             + c_ctx * decode_context + c_pseq * prefill_seqs

where D is piecewise linear in the number of decode rows (knots at 0, 1, 2, 4, ... 32;
linear past the last: a decode step is bound by reading the weights, so its cost is far from
linear in the batch), `prefill_pairs` = sum over prompt chunks of new x (context + (new + 1)
/ 2) (query-key pairs: the attention work) and `decode_context` the summed context of the
decode rows, is what the simulator prices a step with. The raw samples are kept in the JSON
beside the fit, with the residuals, so the model can be checked.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KNOTS = (0, 1, 2, 4, 8, 16, 32)
FEATURES = (*(f"decode_rows@{k}" for k in KNOTS), "prefill_tokens", "prefill_pairs",
            "decode_context", "prefill_seqs")


@dataclass(frozen=True)
class StepSample:
    kind: str  # which scenario produced it
    pieces: tuple[tuple[int, int], ...]  # per scheduled sequence: (context before, new tokens)
    seconds: float


def _tents(x: float) -> list[float]:
    """Linear-interpolation weights of `x` over KNOTS (extrapolated past the last)."""
    w = [0.0] * len(KNOTS)
    for i in range(len(KNOTS) - 1):
        lo, hi = KNOTS[i], KNOTS[i + 1]
        if x <= hi or i == len(KNOTS) - 2:
            t = (x - lo) / (hi - lo)
            w[i], w[i + 1] = 1 - t, t
            return w
    return w


def features(pieces: Sequence[tuple[int, int]]) -> list[float]:
    """The fit's regressors for one step, from (context before, new tokens) per sequence."""
    decode = [c for c, n in pieces if n == 1]
    prefill = [(c, n) for c, n in pieces if n > 1]
    return [*_tents(len(decode)), float(sum(n for _, n in prefill)),
            float(sum(n * (c + (n + 1) / 2) for c, n in prefill)), float(sum(decode)),
            float(len(prefill))]


def fit(samples: Sequence[StepSample]) -> dict[str, float]:
    """Least squares of step seconds on `features`, each sample weighted by 1 / its seconds
    (relative error); a negative coefficient is dropped and the rest refitted."""
    x = np.array([features(s.pieces) for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / y
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
        if (coef >= 0).all():
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(FEATURES, 0.0)
    for k, c in zip(keep, coef, strict=True):
        out[FEATURES[k]] = float(c)
    return out


def predict(coef: dict[str, float], pieces: Sequence[tuple[int, int]]) -> float:
    return sum(coef[f] * v for f, v in zip(FEATURES, features(pieces), strict=True))


def _profile(threads: int, quick: bool) -> list[StepSample]:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_store import resolve_model
    from pdserve.types import GenerateRequest, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
        kv_cache_bytes=512 << 20, max_num_batched_tokens=2048, max_prefill_chunk=512,
        num_threads=threads, step_target_ms=0.0))  # steps as scheduled, not timed
    rng = random.Random(0)
    samples: list[StepSample] = []
    captured: list[tuple[tuple[int, int], ...]] = []
    run = engine.runner.run

    def recording_run(out: Any) -> Any:
        captured.append(tuple((s.start, s.num_new_tokens) for s in out.scheduled))
        return run(out)

    engine.runner.run = recording_run  # type: ignore[method-assign]

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 40000) for _ in range(n))

    def add(ids: tuple[int, ...], max_tokens: int) -> None:
        engine.add_request(GenerateRequest(f"r{rng.random()}", ids, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True)))

    def drain(kind: str, limit: int = 10_000) -> None:
        while engine.has_unfinished() and limit:
            limit -= 1
            captured.clear()
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if captured:
                samples.append(StepSample(kind, captured[0], dt))

    add(prompt(64), 4)  # warm up (lazy init, kernels)
    drain("warmup")
    samples.clear()
    steps = 6 if quick else 12
    batches = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    contexts = (64, 1024) if quick else (64, 512, 1536)
    for context in contexts:
        shared = prompt(context - 8)  # a cached prefix: long contexts without long prefills
        add(shared, 1)
        drain("warm prefix")
        for batch in batches:
            for _ in range(batch):
                add(shared + prompt(8), steps)
            drain(f"decode b={batch} ctx={context}")
    for n in (16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 1500):
        for _ in range(1 if quick else 2):
            add(prompt(n), 1)
            drain(f"prefill {n}")
    for cached, new in ((512, 256), (1024, 128), (256, 1024)):
        ids = prompt(cached)
        add(ids, 1)
        drain("warm prefix")
        add(ids + prompt(new), 1)
        drain(f"prefill {new} after {cached} cached")
    for batch in (4, 16):
        for plen in (96, 1200):
            for _ in range(batch):
                add(prompt(128), 30)
            for _ in range(3):  # let the batch start decoding
                captured.clear()
                engine.step()
            add(prompt(plen), 20)
            drain(f"mixed b={batch} + prompt {plen}")
    return [s for s in samples if s.kind != "warm prefix"]


_BACKGROUND = """
import random, sys, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams
torch.set_num_threads(1)
e = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
    kv_cache_bytes=512 << 20, num_threads=1, enable_prefix_caching=False,
    step_target_ms=0.0))
rng = random.Random(1)
print("ready", flush=True)
while True:
    ids = tuple(rng.randrange(100, 40000) for _ in range(int(sys.argv[1])))
    e.add_request(GenerateRequest(f"b{rng.random()}", ids, SamplingParams(
        max_tokens=int(sys.argv[2]), ignore_eos=True)))
    while e.has_unfinished():
        e.step()
"""


def corun(background_core: int, rounds: int) -> dict[str, Any]:
    """How much slower a step is while another engine computes on the other core (shared
    caches and memory bandwidth): each scenario timed alternately with the background engine
    stopped (SIGSTOP) and running, so drift in what else runs on the machine hits both."""
    import os
    import signal
    import subprocess

    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_store import resolve_model
    from pdserve.types import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
        kv_cache_bytes=512 << 20, num_threads=1, enable_prefix_caching=False,
        step_target_ms=0.0))
    rng = random.Random(2)

    def timed(prompt: int, out: int, decode_only: bool, rows: int) -> float:
        times = []
        for _ in range(rows):
            engine.add_request(GenerateRequest(f"f{rng.random()}", tuple(
                rng.randrange(100, 40000) for _ in range(prompt)), SamplingParams(
                max_tokens=out, ignore_eos=True)))
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:-1] if decode_only else times)

    # One row streams the weights for a token alone: the most memory-bound step there is,
    # the one another core's traffic slows most (the simulator interpolates between the two
    # decode rows by a step's rows).
    scenarios = {"decode b=8": (64, 16, True, 8), "decode b=1": (64, 16, True, 1),
                 "prefill 512": (512, 1, False, 1)}
    out: dict[str, Any] = {}
    for bg_name, bg_args in (("prefill", ("512", "1")), ("decode", ("64", "64"))):
        child = subprocess.Popen(
            ["taskset", "-c", str(background_core), sys.executable, "-c", _BACKGROUND,
             *bg_args], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            while child.stdout.readline().strip() != "ready":  # past the engine's log lines
                if child.poll() is not None:
                    raise RuntimeError("the background engine exited")
            for name, args in scenarios.items():
                solo, co = [], []
                for _ in range(rounds):
                    os.kill(child.pid, signal.SIGSTOP)
                    time.sleep(0.2)
                    solo.append(timed(*args))
                    os.kill(child.pid, signal.SIGCONT)
                    time.sleep(0.2)
                    co.append(timed(*args))
                out[f"{name} beside {bg_name}"] = {
                    "solo_s": statistics.median(solo), "corun_s": statistics.median(co),
                    "slowdown": statistics.median(co) / statistics.median(solo)}
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="fewer scenarios (tests, smoke)")
    ap.add_argument("--corun", type=int, default=None, metavar="CORE",
                    help="instead: step slowdown while an engine computes on CORE")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.corun is not None:
        rec = {"command": "python -m bench.engine_profile " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "corun": corun(args.corun, args.rounds)}
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec, indent=1))
        return 0
    from bench.goodput import machine_info
    from pdserve.engine.cpu import cpu_summary

    samples = _profile(args.threads, args.quick)
    coef = fit(samples)
    resid: dict[str, list[float]] = {}
    for s in samples:
        resid.setdefault(s.kind, []).append(predict(coef, s.pieces) / s.seconds - 1)
    record = {
        "command": "python -m bench.engine_profile " + " ".join(argv or []),
        "machine": {**machine_info(), "cpu_summary": cpu_summary()},
        "threads": args.threads,
        "engine": {"kv_cache_mb": 512, "max_num_batched_tokens": 2048, "max_prefill_chunk": 512},
        "model": ("step_s = D(decode_rows) + c_tok*prefill_tokens + c_pair*prefill_pairs"
                  " + c_ctx*decode_context + c_pseq*prefill_seqs (D: piecewise linear)"),
        "knots": KNOTS,
        "coef": coef,
        "median_relative_residual_by_kind": {k: round(statistics.median(v), 3)
                                             for k, v in resid.items()},
        "samples": [{"kind": s.kind, "pieces": s.pieces, "s": round(s.seconds, 6)}
                    for s in samples],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("coef", "median_relative_residual_by_kind")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
