"""Four real decode workers behind the router: conversations spread over the workers and
each next turn goes back to the worker that holds its history, learned from the workers' KV
events alone; outputs equal transformers'; every block is freed.

Real processes (router, 1 prefill + 4 decode workers), Redis, gRPC and the default model;
the emulated workers of bench.router_harness take the router to 64-256 workers, this takes
the real engines past two."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest

from pdserve.cluster import LocalCluster
from tests.helpers.cluster_util import cluster_fixture, generate, wait_blocks_free
from tests.helpers.hf import hf_greedy

DECODE = 4
CONVERSATIONS = 8
BLOCK = 16  # the engine's default block size
MAX_TOKENS = 8
pytestmark = pytest.mark.timeout(900)

cluster = cluster_fixture(kv_cache_mb=64, prefill=1, decode=DECODE,
                          router_args=("--placement", "threshold", "--remote-threshold", "64"))


def _conversations(seed: int) -> list[list[int]]:
    """First turns of distinct conversations: 96-160 random token ids each (what the engine
    and transformers take alike), so no two share a block."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(96, 161))]
            for _ in range(CONVERSATIONS)]


def _index_blocks(cluster: LocalCluster) -> float:
    page = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    m = re.search(r"^pdserve_router_kv_index_blocks(?:\{[^}]*\})? (\S+)$", page, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def _index_settles(cluster: LocalCluster, blocks: int, timeout_s: float = 30) -> None:
    """Wait until the router's index holds at least `blocks` distinct blocks and has not
    changed for 0.5 s: the prefill worker's events alone can reach the count, the decode
    workers' follow (each publishes within ~20 ms)."""
    deadline = time.monotonic() + timeout_s
    held, since = -1.0, time.monotonic()
    while True:
        now_held = await asyncio.to_thread(_index_blocks, cluster)
        if now_held != held:
            held, since = now_held, time.monotonic()
        elif held >= blocks and time.monotonic() - since >= 0.5:
            return
        assert time.monotonic() < deadline, f"the router's index holds {held} (>= {blocks}?)"
        await asyncio.sleep(0.1)


async def test_turns_return_to_the_worker_holding_their_history(cluster, model_dir) -> None:
    first = _conversations(seed=1)
    # All first turns at once: the router's in-flight count spreads them over the workers.
    turn1 = await asyncio.gather(*(generate(cluster.grpc_address, ids, MAX_TOKENS)
                                   for ids in first))
    used = {r.decode_worker for r in turn1}
    assert len(used) >= DECODE - 1, used  # 8 at once over 4 idle workers: spread
    await _index_settles(cluster, sum(len(ids) // BLOCK for ids in first))
    rng = random.Random(2)
    second = [ids + r.tokens + [rng.randrange(100, 40000) for _ in range(24)]
              for ids, r in zip(first, turn1, strict=True)]
    # One at a time, so that load does not pull a turn away from its history: each goes to
    # the worker that served its first turn and finds that turn's full blocks cached there,
    # prompt and reply (the engine caches a finished request's blocks), without the router
    # asking any worker.
    turn2 = [await generate(cluster.grpc_address, ids, MAX_TOKENS) for ids in second]
    for ids, r1, r2 in zip(first, turn1, turn2, strict=True):
        assert r2.decode_worker == r1.decode_worker, (r1.decode_worker, r2.decode_worker)
        assert r2.route == "local"  # 24-40 uncached tokens, under the remote threshold
        assert r2.cached_tokens >= len(ids) // BLOCK * BLOCK, (len(ids), r2.cached_tokens)
    want = await asyncio.to_thread(hf_greedy, model_dir, first + second, MAX_TOKENS)
    assert [r.tokens for r in turn1 + turn2] == want


async def test_every_block_is_freed_on_every_worker(cluster) -> None:
    for i in range(DECODE):
        free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports[f'decode-{i}']}",
                                             "decode")
        assert free == total, (i, free, total)
    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['prefill-0']}", "prefill")
    assert free == total
