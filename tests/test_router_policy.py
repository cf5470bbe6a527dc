"""Routing decisions: pure functions, no I/O."""

from __future__ import annotations

from engine.types import LatencyClass
from router.policy import DecodeCandidate, Route, RouterPolicy, choose_decode, decide_route

POLICY = RouterPolicy(remote_min_uncached_tokens=256, max_prefill_backlog_tokens=4096)


def test_long_uncached_prompt_goes_remote() -> None:
    d = decide_route(2000, 0, LatencyClass.STANDARD, 0, POLICY)
    assert (d.route, d.reason, d.uncached_tokens) == (Route.REMOTE, "long_uncached_prompt", 2000)


def test_short_prompt_stays_local() -> None:
    d = decide_route(100, 0, LatencyClass.INTERACTIVE, 0, POLICY)
    assert (d.route, d.reason) == (Route.LOCAL, "short_prompt")


def test_long_prompt_with_cached_prefix_stays_local() -> None:
    d = decide_route(2000, 1920, LatencyClass.STANDARD, 0, POLICY)
    assert (d.route, d.reason, d.uncached_tokens) == (Route.LOCAL, "cached_prefix", 80)


def test_no_prefill_worker_or_backlog_keeps_prefill_local() -> None:
    assert decide_route(2000, 0, LatencyClass.STANDARD, None, POLICY).reason == \
        "no_prefill_worker"
    assert decide_route(2000, 0, LatencyClass.STANDARD, 5000, POLICY).reason == \
        "prefill_backlog"


def test_batch_requests_yield_the_prefill_pool_first() -> None:
    backlog = 3000  # under the limit, over the batch share of it
    assert decide_route(2000, 0, LatencyClass.INTERACTIVE, backlog, POLICY).route is Route.REMOTE
    assert decide_route(2000, 0, LatencyClass.BATCH, backlog, POLICY).route is Route.LOCAL


def _cand(wid: str, cached: int, running: float, free: float = 100) -> DecodeCandidate:
    return DecodeCandidate(wid, cached, running, 0, free, 100)


def test_choose_decode_prefers_less_load() -> None:
    best = choose_decode([_cand("a", 0, 10), _cand("b", 0, 1)], 500, POLICY)
    assert best.worker_id == "b"


def test_choose_decode_prefers_cache_affinity_over_small_load_gap() -> None:
    best = choose_decode([_cand("a", 480, 5), _cand("b", 0, 4)], 500, POLICY)
    assert best.worker_id == "a"
