"""Cost placement end to end: a real 1P1D cluster whose router places by predicted cost
(router.cost) and corrects its predictions by what they missed (router.calibration).
Outputs equal transformers' whatever the route, every first token is compared with its
prediction on /metrics, the corrections stay bounded, and every block is freed.

Real processes (router, 1 prefill + 1 decode worker), Redis, gRPC and the default model."""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest

from tests.helpers.cluster_util import cluster_fixture, generate, wait_blocks_free
from tests.helpers.hf import hf_greedy

WINDOW = 6  # first tokens per route before its correction applies (min_samples = window)
MAX_TOKENS = 6
pytestmark = pytest.mark.timeout(900)

cluster = cluster_fixture(kv_cache_mb=64, prefill=1, decode=1,
                          router_args=("--placement", "cost",
                                       "--cost-calibration-window", str(WINDOW)))


def _metric(page: str, name: str, route: str) -> float | None:
    m = re.search(rf'^{name}\{{[^}}]*route="{route}"[^}}]*\}} (\S+)$', page, re.MULTILINE)
    return float(m.group(1)) if m else None


async def test_cost_placement_learns_its_misses_and_changes_no_token(cluster, model_dir) -> None:
    rng = random.Random(5)
    # Distinct prompts (no shared blocks): short ones, prefilled where they decode, and
    # long ones, which an idle cluster's cost model may send to the prefill worker.
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(24, 80))]
               for _ in range(10)]
    prompts += [[rng.randrange(100, 40000) for _ in range(rng.randrange(500, 700))]
                for _ in range(4)]
    # The first is predicted from the model's priors; the rest, once a heartbeat brought
    # the decode worker's measured rates, from those: only they teach the correction.
    results = [await generate(cluster.grpc_address, prompts[0], MAX_TOKENS)]
    await asyncio.sleep(2.5)
    results += [await generate(cluster.grpc_address, ids, MAX_TOKENS) for ids in prompts[1:]]
    want = await asyncio.to_thread(hf_greedy, model_dir, prompts, MAX_TOKENS)
    assert [r.tokens for r in results] == want  # the route never changes a token

    page = (await asyncio.to_thread(httpx.get, f"{cluster.http_url}/metrics", timeout=10)).text
    counted = {route: _metric(page, "pdserve_router_ttft_prediction_ratio_count", route) or 0.0
               for route in ("local", "remote")}
    routes = {route: sum(r.route == route for r in results) for route in counted}
    # Every request placed once and served where it was placed: one first token compared.
    assert counted == {route: float(n) for route, n in routes.items()}, (counted, routes)
    assert routes["local"] > WINDOW  # the short prompts at least
    for route, n in routes.items():
        correction = _metric(page, "pdserve_router_ttft_correction_seconds", route)
        # The median of what its predictions missed, bounded; none before WINDOW of them.
        assert correction is None or -0.5 <= correction <= 0.5, (route, correction)
        if n < WINDOW:
            assert not correction
    local = _metric(page, "pdserve_router_ttft_correction_seconds", "local")
    assert local is not None and local != 0.0  # 9 short prompts from measured rates


async def test_every_block_is_freed(cluster) -> None:
    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['decode-0']}", "decode")
    assert free == total
    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['prefill-0']}", "prefill")
    assert free == total
