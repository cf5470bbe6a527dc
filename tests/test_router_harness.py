"""The router load harness (bench.router_harness) end to end, small: a real router process,
a real redis-server and 4 emulated decode workers (the real DecodeWorker and gRPC servicer
over bench.emulated_engine), a few dozen requests of both workloads. Every request gets
exactly its deterministic tokens, the router's index equals the workers' caches, and the
emulated engine's prefix cache behaves as the real block manager's."""

from __future__ import annotations

import asyncio
import math
import random
import shutil
from pathlib import Path

import pytest

from bench.emulated_engine import CacheOracle, EmulatedEngine, emulated_token
from pdserve.kv_events import KVOp
from pdserve.types import GenerateRequest, SamplingParams


def test_emulated_engine_tokens_cache_and_events() -> None:
    async def main() -> None:
        oracle = CacheOracle()
        async with EmulatedEngine(worker_id="w0", model_id="m", num_blocks=64,
                                  time_scale=0.001, oracle=oracle) as eng:
            await eng.kv_snapshot()  # the publisher's baseline
            prompt = tuple(range(1, 41))  # 2 full blocks + 8 tokens
            req = GenerateRequest("r1", prompt, SamplingParams(max_tokens=5))
            toks = [ev.token_id async for ev in eng.generate(req)]
            assert toks == [emulated_token(40, 40, i) for i in range(5)]
            # prompt + 4 fed-back outputs = 44 tokens computed: 2 full blocks cached
            assert await eng.num_cached_tokens(list(prompt)) == 32
            ops = await eng.take_kv_events()
            assert ops is not None and [op for op, _ in ops] == [KVOp.STORED] * 2
            hashes = eng.prompt_hashes(list(prompt))
            assert oracle.best_blocks(hashes) == 2
            assert eng.cached_tokens_now(hashes) == 32
            # the same prompt again is served from the cache
            req2 = GenerateRequest("r2", prompt, SamplingParams(max_tokens=1))
            evs = [ev async for ev in eng.generate(req2)]
            assert evs[-1].num_cached_tokens == 32
            assert set(await eng.kv_snapshot()) == {h for _, h in ops}

    asyncio.run(main())


@pytest.mark.slow  # starts redis-server, the router and the workers' process
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_harness_quick(tmp_path: Path) -> None:
    from bench.router_harness import QUICK, run

    cfg = QUICK.__class__(**{**QUICK.__dict__, "light_s": 1.5, "saturate_s": 1.5,
                             "warmup_s": 0.5, "idle_s": 0.5})
    record = asyncio.run(run(cfg, tmp_path))
    (res,) = record["results"]
    assert res["workers"] == 4
    assert res["bad_token_requests"] == 0
    assert res["index_blocks"] == res["workers_distinct_blocks"]
    total = 0
    for name, phase in res["phases"].items():
        assert phase["errors"] == {}, name
        assert phase["ok"] == phase["requests"] > 0, name
        if name.endswith("/direct"):  # straight to the workers: the latency baseline
            assert phase["matched_worker_records"] == phase["ok"], name
            assert phase["hop_overhead_ms"]["n"] == phase["ok"], name
            light = res["phases"][name.replace("direct", "light")]
            assert set(light["router_added_ms"]) == {"p50", "p90", "p99"}, name
            continue
        if name.endswith("/paired"):  # routed and direct in turn, every one matched
            assert phase["ok"] == 2 * cfg.paired, name
            assert phase["added_latency_ms"]["n"] == phase["hop_overhead_ms"]["n"] == cfg.paired
            assert None not in phase["router_added_ms"].values(), name
            for q in ("p50", "p99"):  # and their 95 % bootstrap interval
                lo, hi = phase["router_added_ms_ci95"][q]
                assert lo <= hi, (name, q)
            # the router's own time, measured inside it, for every routed request
            own = phase["router_overhead_ms"]
            assert own["total"]["n"] == own["in"]["n"] == own["out"]["n"] == cfg.paired
            assert 0 < own["in"]["p50"] < own["total"]["p50"] <= own["total"]["p99"], own
            continue
        # every request was seen by a worker, with the router's own timings
        assert phase["matched_worker_records"] == phase["ok"], name
        assert phase["route_ms"]["n"] == phase["ok"], name
        assert phase["router_overhead_ms"]["total"]["n"] == phase["ok"], name
        # Every placement counted its thread's CPU (pdserve_router_placement_cpu_seconds).
        assert phase["router_decisions_counted"] >= phase["ok"], name
        assert phase["placement_cpu_us_per_decision"] > 0, name
        assert phase["oracle_hit_rate"] >= phase["prefix_hit_rate"], name
        total += phase["ok"]
    assert total >= 24
    assert any(name.endswith("/direct") for name in res["phases"])
    assert any(name.endswith("/paired") for name in res["phases"])
    check = res["index_check"]
    assert check["router_equals_workers"], check
    assert check["follower_index_equals_caches"], check


def test_overhead_quantiles_from_buckets() -> None:
    """The router's own-time quantiles come from the histogram's bucket counts between two
    scrapes, interpolated within a bucket as Prometheus's histogram_quantile does."""
    from bench.router_harness import overhead_ms

    def scrape(counts: dict[float, float]) -> dict[str, float]:
        out, running = {}, 0.0
        for le in (0.0001, 0.0002, 0.0003, 0.0004, math.inf):
            running += counts.get(le, 0.0)
            out[f"overhead:total:{le:g}" if le != math.inf else "overhead:total:+Inf"] = running
        return out

    before = scrape({0.0001: 7})  # earlier requests: not in the difference
    after = scrape({0.0001: 7, 0.0002: 50, 0.0003: 40, 0.0004: 10})
    got = overhead_ms(before, after)["total"]
    assert got["n"] == 100
    assert got["p50"] == 0.2  # the 50th of 100 is the last of the 0.1-0.2 ms bucket
    assert got["p90"] == 0.3
    assert math.isclose(got["p99"], 0.39)
    assert overhead_ms(after, after)["in"] == {"n": 0}
    tail = overhead_ms(before, scrape({0.0001: 7, math.inf: 3}))["total"]
    assert tail["p99"] == 0.4  # past the last finite bound: that bound


def test_paired_interval() -> None:
    """The bootstrap interval of a quantile difference: exact for a constant shift (pairs
    are resampled as pairs), around the true shift and narrower with more pairs for noisy
    samples, none with too few pairs."""
    from bench.router_harness import paired_interval

    shifted = [(1.0 + 0.01 * i, 0.5 + 0.01 * i) for i in range(200)]
    assert paired_interval(shifted, 0.5) == paired_interval(shifted, 0.99) == [0.5, 0.5]
    rng = random.Random(3)
    noisy = [(2.0 + rng.expovariate(1.0), 1.0 + rng.expovariate(1.0)) for _ in range(4000)]
    lo_few, hi_few = paired_interval(noisy[:200], 0.5)  # type: ignore[misc]
    lo, hi = paired_interval(noisy, 0.5)  # type: ignore[misc]
    assert lo < 1.0 < hi and lo_few < 1.0 < hi_few
    assert hi - lo < (hi_few - lo_few) / 2
    assert paired_interval(shifted[:19], 0.5) is None
