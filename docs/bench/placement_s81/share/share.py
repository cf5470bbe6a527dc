"""Two routers with and without shared in-flight counts (pdserve.control.inflight), on one
cluster: cluster up's 1P2D, threshold placement, closed-loop chat streams as
../../placement_s80/herd2/herd2.py sends them (bench.sim.real's streaming workload: 64-128-token
prompts, 64 tokens out, 6 requests a stream). Four routers on one Redis: `router` and
`router-1` share their counts (the default, every 0.05 s), `router-2` and `router-3` run with
--share-inflight 0 (each sees the other's requests only through heartbeats, as before). Each
round sends 2, 4 and 8 streams all through `router` (one), then half through each of a
pair (shared, unshared), the three in an order that changes from round to round. Every
pass sends prompts of its own (a seed per round, mode and concurrency): a pass that reused
another's would follow their cached prefixes (cache affinity), not the load. Records each
pass's TTFT and TPOT p50 and, from every router's log (router at INFO), each decision (when,
where, which router) and each request's end, for busier.py.
usage: share.py OUT.json  (run from the tree to measure, PYTHONPATH at it; bench.records
compressed the record here afterwards)"""
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from bench.goodput import TIMINGS_HEADER, Setup
from bench.loadgen.config import RunConfig
from bench.loadgen.runner import run_load
from bench.sim.real import _chat_streams
from pdserve.cluster import LocalCluster

ORDERS = (("one", "shared", "unshared"), ("unshared", "shared", "one"),
          ("shared", "unshared", "one"))


PER_STREAM = 8  # requests


async def streams(urls: list[str], c: int, seed: int, warmup: int) -> dict[str, object]:
    """c closed-loop streams, PER_STREAM requests each, split evenly over `urls`."""
    share = c // len(urls)
    runs = await asyncio.gather(*(run_load(RunConfig(
        url=u, workload=_chat_streams(), num_requests=PER_STREAM * share, concurrency=share,
        ignore_eos=True, seed=seed + k, warmup_requests=warmup,
        headers={TIMINGS_HEADER: "1"})) for k, u in enumerate(urls)))
    ttft = sorted(r.ttft_s for run in runs for r in run.requests if r.ok and r.ttft_s)
    tpot = sorted(r.tpot_s for run in runs for r in run.requests if r.ok and r.tpot_s)
    errors = sum(run.summary.overall.num_errors for run in runs)
    return {"ttft_p50_ms": 1e3 * ttft[len(ttft) // 2] if ttft else None,
            "tpot_p50_ms": 1e3 * tpot[len(tpot) // 2] if tpot else None, "errors": errors,
            "requests": len(ttft)}


def peers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve_router_peer_routers"))


async def main(out: Path) -> None:
    logs = out.with_suffix(".logs")
    setup = Setup(log_dir=logs, router_extra=("--log-level", "INFO"))
    passes = []
    args = ("--remote-threshold", str(setup.remote_threshold),
            "--max-prefill-backlog", str(setup.max_prefill_backlog),
            "--placement", "threshold", *setup.router_extra)
    cluster = LocalCluster(
        prefill=1, decode=2, model=setup.model,
        extra_worker_args=(*setup.engine_args(None), "--log-level", "WARNING"),
        router_args=args, log_dir=logs, env=dict(setup.worker_env))
    logs.mkdir(parents=True, exist_ok=True)
    with cluster:
        url = {"router": cluster.http_url}
        url["router-1"] = f"http://127.0.0.1:{cluster.add_router(1)[1]}"
        cluster.router_args = (*args, "--share-inflight", "0")
        for i in (2, 3):
            url[f"router-{i}"] = f"http://127.0.0.1:{cluster.add_router(i)[1]}"
        await asyncio.sleep(1.0)
        seen = {name: peers(u) for name, u in url.items()}
        print("peers", seen, flush=True)
        routers = {"one": [url["router"]], "shared": [url["router"], url["router-1"]],
                   "unshared": [url["router-2"], url["router-3"]]}
        for rnd, order in enumerate(ORDERS):
            for mode in order:
                for i, c in enumerate((2, 4, 8)):
                    t0 = time.time()
                    seed = 1000 * rnd + 100 * ("one", "shared", "unshared").index(mode) + 10 * i
                    r = await streams(routers[mode], c, seed,
                                      1 if (rnd, mode, i) == (0, order[0], 0) else 0)
                    passes.append({"round": rnd, "mode": mode, "concurrency": c,
                                   "start": t0, "end": time.time(), **r})
                    print(passes[-1], flush=True)
                    await asyncio.sleep(2.0)  # a heartbeat or two between passes
    decisions, ends = [], []
    for name in url:
        for line in (logs / f"{name}.log").read_text().splitlines():
            if '"route_decision"' in line:
                d = json.loads(line)
                decisions.append((d["timestamp"], d["decode"], d["request_id"], name))
            elif '"request finished"' in line:
                d = json.loads(line)
                ends.append((d["timestamp"], d["request_id"], d.get("outcome")))
    out.write_text(json.dumps({"peers": seen, "passes": passes,  # noqa: ASYNC240
                               "decisions": decisions, "ends": ends}, indent=1))


asyncio.run(main(Path(sys.argv[1])))
