"""Where a streamed token's time goes between the engine's step and the client (issue 20, item 0).

    python -m bench.serving_path [--dtypes float32,int8] [--out docs/bench/serving_path.json]
                                 [--baseline-tree DIR]

One greedy stream (200-token prompt of fixed ids, `--tokens` output tokens, ignore_eos), best
of `--reps`, median gap between consecutive tokens (the first excluded), measured at each
hop in one run on this machine, for each of `--dtypes`:

1. `engine`: `LLMEngine.step()` in a loop on the main thread, nothing else in the process.
2. `engine_beside_pool`: the same on a second thread while a third thread that ran one torch
   op stays alive (what `asyncio.to_thread(LLMEngine.from_dir, ...)` left behind in every
   worker: an idle OpenMP pool, so libgomp sees more threads than CPUs and stops spinning).
3. A 1P1D `LocalCluster` (no cluster secret, so its decode worker can be called directly):
   `decode_grpc` (the decode worker's own Generate stream), `router_grpc` (the router's
   client API, pdserve.client) and `http_sse` (the OpenAI-compatible /v1/completions stream).

Ratios are against `engine` of the same run. With `--rounds N` the engine and the three hops
are also measured alternately, N rounds beside one idle cluster, and each hop's ratio is the
median of its per-round ratios: the step's own time drifts between minutes on a shared VM
(16-19 ms for float32 between two runs here), more than the gap being measured.
`--baseline-tree DIR` (e.g. a `git worktree` of
an earlier commit) measures part 3 against the code in DIR first, in a child process whose
working directory and PYTHONPATH are DIR, so its cluster runs that code.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = list(range(1000, 1200))


def _median_gap_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # the first token excluded
    return statistics.median(gaps) * 1000


def _best(fn: Callable[[], float], reps: int) -> float:
    return min(fn() for _ in range(reps))


def _engine_stream(dtype: str, tokens: int) -> Callable[[], float]:
    """One greedy stream through `LLMEngine.step()` on the calling thread: its median gap."""
    from pdserve.engine import model_store
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.types import GenerateRequest, SamplingParams

    engine = LLMEngine.from_dir(model_store.resolve_model(None),
                                EngineConfig(kv_cache_bytes=128 << 20, dtype=dtype))
    n = iter(range(1 << 30))

    def one_stream() -> float:
        engine.add_request(GenerateRequest(f"r{next(n)}", tuple(PROMPT),
                                           SamplingParams(max_tokens=tokens, ignore_eos=True)))
        stamps = [time.perf_counter()]
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
        return _median_gap_ms(stamps)

    return one_stream


def _engine_parts(dtype: str, tokens: int, reps: int) -> dict[str, float]:
    import torch

    one_stream = _engine_stream(dtype, tokens)
    out = {"engine": _best(one_stream, reps)}
    hold = threading.Event()

    def idle_pool() -> None:
        torch.ones(1 << 20).sum()  # one parallel op: this thread now keeps an OpenMP pool
        hold.wait()

    keeper = threading.Thread(target=idle_pool, daemon=True)
    keeper.start()
    time.sleep(0.2)
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(_best(one_stream, reps)))
    worker.start()
    worker.join()
    hold.set()
    keeper.join()
    out["engine_beside_pool"] = result[0]
    return out


async def _decode_grpc(address: str, tokens: int) -> float:
    import grpc

    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeWorkerStub(channel)
        req = decode_pb2.DecodeGenerateRequest(input=common_pb2.GenerateInput(
            request_id=f"bench-{time.monotonic_ns()}", prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True)))
        stamps = [time.perf_counter()]
        async for _ in stub.Generate(req, timeout=300):
            stamps.append(time.perf_counter())
    return _median_gap_ms(stamps)


async def _router_grpc(address: str, tokens: int) -> float:
    from pdserve.client import RouterClient, Sampling

    async with RouterClient(address) as client:
        stamps = [time.perf_counter()]
        async for chunk in client.generate(token_ids=PROMPT, sampling=Sampling(
                max_tokens=tokens, ignore_eos=True)):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
    return _median_gap_ms(stamps)


def _http_sse(url: str, tokens: int) -> float:
    import httpx

    stamps = [time.perf_counter()]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
            "prompt": PROMPT, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                stamps.append(time.perf_counter())
    return _median_gap_ms(stamps)


def _cluster_parts(dtype: str, tokens: int, reps: int) -> dict[str, float]:
    from pdserve.cluster import LocalCluster
    from pdserve.engine import model_store

    model_dir = model_store.resolve_model(None)
    with LocalCluster(prefill=1, decode=1, model=str(model_dir), cluster_secret="",
                      extra_worker_args=("--dtype", dtype)) as c:
        decode = f"127.0.0.1:{c.ports['decode-0']}"
        return {
            "decode_grpc": _best(lambda: asyncio.run(_decode_grpc(decode, tokens)), reps),
            "router_grpc": _best(lambda: asyncio.run(_router_grpc(c.grpc_address, tokens)),
                                 reps),
            "http_sse": _best(lambda: _http_sse(c.http_url, tokens), reps),
        }


def _interleaved(dtype: str, tokens: int, rounds: int) -> dict[str, Any]:
    """The engine's step and each hop measured alternately, `rounds` times, beside the same
    idle 1P1D cluster: a ratio per round from measurements seconds apart, so the machine's
    drift between minutes (its memory bandwidth moves 30-63 GB/s run to run here) cancels.
    The in-process engine is built first, so it never computes while a hop is measured."""
    from pdserve.cluster import LocalCluster
    from pdserve.engine import model_store

    engine = _engine_stream(dtype, tokens)
    model_dir = model_store.resolve_model(None)
    with LocalCluster(prefill=1, decode=1, model=str(model_dir), cluster_secret="",
                      extra_worker_args=("--dtype", dtype)) as c:
        decode = f"127.0.0.1:{c.ports['decode-0']}"
        hops: dict[str, Callable[[], float]] = {
            "decode_grpc": lambda: asyncio.run(_decode_grpc(decode, tokens)),
            "router_grpc": lambda: asyncio.run(_router_grpc(c.grpc_address, tokens)),
            "http_sse": lambda: _http_sse(c.http_url, tokens)}
        for hop in hops.values():  # warm every path once
            hop()
        rows: list[dict[str, float]] = []
        for _ in range(rounds):
            row = {"engine": engine()}
            for name, hop in hops.items():
                row[name] = hop()
            rows.append(row)
    ratios = {k: statistics.median(r[k] / r["engine"] for r in rows)
              for k in rows[0] if k != "engine"}
    return {"rounds": rows, "median_ratio_to_engine": ratios}


def _interleaved_child(dtype: str, tokens: int, rounds: int) -> dict[str, Any]:
    """`_interleaved` in a child process of its own. A process that has had more OpenMP
    threads than CPUs (here: `engine_beside_pool`'s idle pool) keeps libgomp from spinning for
    the rest of its life; its engine then steps ~1.4x slower, and every ratio would be
    flattered."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "bench.serving_path", "--interleaved-only",
                        "--dtypes", dtype, "--tokens", str(tokens), "--rounds", str(rounds),
                        "--out", out.name], cwd=Path(__file__).resolve().parents[1],
                       check=True)
        result: dict[str, Any] = json.loads(Path(out.name).read_text())[dtype]
    return result


def _baseline(tree: Path, dtypes: list[str], tokens: int, reps: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--cluster-only",
                        "--dtypes", ",".join(dtypes), "--tokens", str(tokens), "--reps",
                        str(reps), "--out", out.name],
                       cwd=tree, env=env, check=True)
        record: dict[str, Any] = json.loads(Path(out.name).read_text())
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return {"tree": str(tree), "commit": commit, **record["tpot_ms"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline-tree", type=Path, default=None)
    ap.add_argument("--cluster-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=0,
                    help="also measure the engine and each hop alternately, this many rounds "
                         "beside one idle cluster, and report the median per-round ratio")
    ap.add_argument("--interleaved-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if args.interleaved_only:  # a fresh process per dtype: see _interleaved_child
        record = {d: _interleaved(d, args.tokens, args.rounds) for d in dtypes}
        if args.out:
            args.out.write_text(json.dumps(record))
        return 0
    if args.cluster_only:  # the baseline child: part 3 with the code of its tree
        record: dict[str, Any] = {"tpot_ms": {d: _cluster_parts(d, args.tokens, args.reps)
                                              for d in dtypes}}
        if args.out:
            args.out.write_text(json.dumps(record))
        return 0
    from pdserve.engine.cpu import cpu_summary

    started = time.time()
    baseline = (_baseline(args.baseline_tree.resolve(), dtypes, args.tokens, args.reps)
                if args.baseline_tree else None)
    tpot: dict[str, dict[str, float]] = {}
    interleaved: dict[str, dict[str, Any]] = {}
    for d in dtypes:
        tpot[d] = _engine_parts(d, args.tokens, args.reps)
        tpot[d].update(_cluster_parts(d, args.tokens, args.reps))
        if args.rounds:
            interleaved[d] = _interleaved_child(d, args.tokens, args.rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    record = {
        "benchmark": "bench.serving_path", "commit": commit, "dirty": dirty,
        "machine": {"cpu": cpu_summary(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "config": {"prompt_tokens": len(PROMPT), "output_tokens": args.tokens,
                   "reps": args.reps, "dtypes": dtypes, "cluster": "1P1D, no secret"},
        "tpot_ms": tpot,
        "ratio_to_engine": {d: {k: v / t["engine"] for k, v in t.items()}
                            for d, t in tpot.items()},
        "interleaved": interleaved or None,
        "baseline": baseline,
        "total_s": round(time.time() - started, 1),
    }
    print(f"CPU: {cpu_summary()}")
    for d, t in tpot.items():
        print(f"--- {d}")
        if baseline:
            print(f"baseline {baseline['commit']}: " + ", ".join(
                f"{k} {v:.2f} ms ({v / t['engine']:.2f}x)" for k, v in baseline[d].items()))
        for k, v in t.items():
            print(f"{k:>20}: {v:6.2f} ms  {v / t['engine']:.2f}x the engine's step")
        if d in interleaved:
            print(f"interleaved, {args.rounds} rounds, median ratio per round: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in interleaved[d]["median_ratio_to_engine"].items()))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
