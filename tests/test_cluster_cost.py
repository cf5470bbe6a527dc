"""Cost placement end to end: a real 1P1D cluster whose router places by predicted cost
(router.cost) and learns its fixed cost of a remote prefill from the allocation + hand-off
it measures (router.calibration). Outputs equal transformers' whatever the route, every
first token is compared with its prediction on /metrics, the learned correction stays
bounded, and every block is freed.

Real processes (router, 1 prefill + 1 decode worker), Redis, gRPC and the default model."""

from __future__ import annotations

import asyncio
import collections
import os
import random
import re

import httpx
import pytest

from tests.helpers.cluster_util import cluster_fixture, generate, wait_blocks_free
from tests.helpers.hf import hf_greedy

WINDOW = 4  # remote requests before the correction applies (min_samples = window)
MAX_TOKENS = 6
pytestmark = pytest.mark.timeout(900)

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = [pytestmark, pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")]
# Each worker on a CPU of its own, as bench.goodput lays 1P1D out: a remote prefill then
# computes beside the decode worker's streams, not on their CPU (router.cost), so a queue on
# the decode worker sends the next long prompts to the prefill worker.
cluster = cluster_fixture(kv_cache_mb=256, prefill=1, decode=1,
                          extra_prefill_args=("--cpus", str(CPUS[0]), "--nice", "0"),
                          extra_decode_args=("--cpus", str(CPUS[-1])),
                          router_args=("--placement", "cost",
                                       "--remote-overhead-window", str(WINDOW)))


def _metric(page: str, name: str, route: str | None = None) -> float | None:
    labels = rf'\{{[^}}]*route="{route}"[^}}]*\}}' if route else r'(?:\{[^}]*\})?'
    m = re.search(rf"^{name}{labels} (\S+)$", page, re.MULTILINE)
    return float(m.group(1)) if m else None


async def test_cost_placement_learns_the_remote_overhead_and_changes_no_token(
        cluster, model_dir) -> None:
    rng = random.Random(5)

    def prompts(n: int, lo: int, hi: int) -> list[list[int]]:  # distinct: no shared blocks
        return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))]
                for _ in range(n)]

    async def metrics() -> str:
        return (await asyncio.to_thread(httpx.get, f"{cluster.http_url}/metrics",
                                        timeout=10)).text

    warm = prompts(1, 24, 40)
    # The first request is priced from the model's priors; once a heartbeat brought the
    # decode worker's measured step, remote requests teach the correction.
    results = [await generate(cluster.grpc_address, warm[0], MAX_TOKENS)]
    await asyncio.sleep(2.5)
    routes: collections.Counter[str] = collections.Counter(r.route for r in results)
    # Bursts of long prompts: the router's in-flight accounting sees the first ones queued
    # on the decode worker and sends the next ones to the prefill worker, at any CPU speed.
    # First through the REST API, whose handler stops reading a stream at its last event:
    # what the router learns of a request is learned before that event goes out.
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as http:
        async def complete(ids: list[int]) -> str:
            r = await http.post("/v1/completions", json={
                "model": model_dir.name, "prompt": ids, "max_tokens": MAX_TOKENS,
                "temperature": 0}, headers={"X-Pdserve-Timings": "1"})  # route + timings
            assert r.status_code == 200, r.text
            return str(r.json()["pdserve"]["route"])

        for _ in range(2):
            routes.update(await asyncio.gather(*(complete(ids)
                                                 for ids in prompts(8, 300, 400))))
    assert routes["remote"] >= WINDOW, routes
    correction = _metric(await metrics(), "pdserve_router_remote_overhead_correction_seconds")
    # The median miss of the measured allocation + hand-off, bounded.
    assert correction is not None and correction != 0.0 and -0.5 <= correction <= 0.5

    # And through gRPC, token for token against transformers: the route changes no token.
    burst = prompts(8, 300, 400)
    grpc_results = await asyncio.gather(*(generate(cluster.grpc_address, ids, MAX_TOKENS)
                                          for ids in burst))
    results += grpc_results
    routes.update(r.route for r in grpc_results)
    want = await asyncio.to_thread(hf_greedy, model_dir, warm + burst, MAX_TOKENS)
    assert [r.tokens for r in results] == want

    page = await metrics()
    counted = {route: _metric(page, "pdserve_router_ttft_prediction_ratio_count", route) or 0.0
               for route in ("local", "remote")}
    # Every request placed once and served where it was placed: one first token compared.
    assert counted == {route: float(routes[route]) for route in counted}, (counted, routes)


async def test_every_block_is_freed(cluster) -> None:
    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['decode-0']}", "decode")
    assert free == total
    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['prefill-0']}", "prefill")
    assert free == total
