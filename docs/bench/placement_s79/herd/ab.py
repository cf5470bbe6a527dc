"""Closed-loop chat streams (bench.sim.real's streaming workload: 64-128-token prompts, 64
tokens out) on cluster up's 1P2D, threshold placement, router at INFO: TTFT and TPOT p50
per concurrency, and how the requests were spread over the two decode workers.
usage: ab.py OUT.json  (run from the tree to measure, PYTHONPATH at it)"""
import asyncio
import json
import sys
from pathlib import Path

from bench.goodput import TIMINGS_HEADER, Setup
from bench.loadgen.config import RunConfig
from bench.loadgen.runner import run_load
from bench.sim.real import _chat_streams, one_p_two_d


async def main(out: Path) -> None:
    logs = out.with_suffix(".logs")
    setup = Setup(log_dir=logs, router_extra=("--log-level", "INFO"))
    result = {}
    with one_p_two_d(setup, "threshold") as system:
        for i, c in enumerate((2, 4, 8)):
            cfg = RunConfig(url=system.url, workload=_chat_streams(), num_requests=6 * c,
                            concurrency=c, ignore_eos=True, seed=100 + i,
                            warmup_requests=1 if i == 0 else 0, headers={TIMINGS_HEADER: "1"})
            run = await run_load(cfg)
            o = run.summary.overall
            result[c] = {"ttft_p50_ms": o.ttft_ms and o.ttft_ms.p50,
                         "ttft_p90_ms": o.ttft_ms and o.ttft_ms.p90,
                         "tpot_p50_ms": o.tpot_ms and o.tpot_ms.p50,
                         "tpot_p90_ms": o.tpot_ms and o.tpot_ms.p90,
                         "errors": o.num_errors}
            print(c, result[c], flush=True)
    decisions = []
    for line in (next(logs.iterdir()) / "router.log").read_text().splitlines():
        if '"route_decision"' in line:
            d = json.loads(line)
            decisions.append((d["timestamp"], d["decode"], d["request_id"]))
    out.write_text(json.dumps({"runs": result, "decisions": decisions}, indent=1))  # noqa: ASYNC240


asyncio.run(main(Path(sys.argv[1])))
