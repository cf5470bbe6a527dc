"""Closed-loop chat streams (bench.sim.real's streaming workload: 64-128-token prompts, 64
tokens out) on cluster up's 1P2D with threshold placement and two routers on one Redis
(the second added as the replica test adds it): every concurrency's streams sent all
through one router, then half through each, alternated, on the same cluster. Records each
pass's TTFT and TPOT p50 and the routers' decisions (router at INFO: where each request
went, and which router placed it), for bursts.py-style counting.
usage: herd2.py OUT.json  (run from the tree to measure, PYTHONPATH at it; bench.records
compressed the record here afterwards)"""
import asyncio
import json
import sys
import time
from pathlib import Path

from bench.goodput import TIMINGS_HEADER, Setup
from bench.loadgen.config import RunConfig
from bench.loadgen.runner import run_load
from bench.sim.real import _chat_streams
from pdserve.cluster import LocalCluster


async def streams(urls: list[str], c: int, seed: int, warmup: int) -> dict[str, object]:
    """c closed-loop streams, 6 requests each, split evenly over `urls`."""
    share = c // len(urls)
    runs = await asyncio.gather(*(run_load(RunConfig(
        url=u, workload=_chat_streams(), num_requests=6 * share, concurrency=share,
        ignore_eos=True, seed=seed + k, warmup_requests=warmup,
        headers={TIMINGS_HEADER: "1"})) for k, u in enumerate(urls)))
    ttft = sorted(r.ttft_s for run in runs for r in run.requests if r.ok and r.ttft_s)
    tpot = sorted(r.tpot_s for run in runs for r in run.requests if r.ok and r.tpot_s)
    errors = sum(run.summary.overall.num_errors for run in runs)
    return {"ttft_p50_ms": 1e3 * ttft[len(ttft) // 2] if ttft else None,
            "tpot_p50_ms": 1e3 * tpot[len(tpot) // 2] if tpot else None, "errors": errors,
            "requests": len(ttft)}


async def main(out: Path) -> None:
    logs = out.with_suffix(".logs")
    setup = Setup(log_dir=logs, router_extra=("--log-level", "INFO"))
    passes = []
    # bench.sim.real.one_p_two_d's cluster (cluster up's placement), threshold placement
    cluster = LocalCluster(
        prefill=1, decode=2, model=setup.model,
        extra_worker_args=(*setup.engine_args(None), "--log-level", "WARNING"),
        router_args=("--remote-threshold", str(setup.remote_threshold),
                     "--max-prefill-backlog", str(setup.max_prefill_backlog),
                     "--placement", "threshold", *setup.router_extra),
        log_dir=logs, env=dict(setup.worker_env))
    logs.mkdir(parents=True, exist_ok=True)
    with cluster:
        _, http_port = cluster.add_router(1)
        first, second = cluster.http_url, f"http://127.0.0.1:{http_port}"
        for rnd in range(2):
            for routers in ((first,), (first, second)):
                for i, c in enumerate((2, 4, 8)):
                    t0 = time.time()
                    r = await streams(list(routers), c, 100 * rnd + 10 * i,
                                      1 if (rnd, i) == (0, 0) else 0)
                    passes.append({"round": rnd, "routers": len(routers), "concurrency": c,
                                   "start": t0, "end": time.time(), **r})
                    print(passes[-1], flush=True)
                    await asyncio.sleep(2.0)  # a heartbeat or two between passes
    decisions = []
    for name in ("router", "router-1"):
        for line in (logs / f"{name}.log").read_text().splitlines():
            if '"route_decision"' in line:
                d = json.loads(line)
                decisions.append((d["timestamp"], d["decode"], d["request_id"], name))
    out.write_text(json.dumps({"passes": passes, "decisions": decisions}, indent=1))  # noqa: ASYNC240


asyncio.run(main(Path(sys.argv[1])))
