"""Routing decisions: pure functions, no I/O."""

from __future__ import annotations

import time

import pytest

from pdserve.types import LatencyClass
from router.clients import PrefillOutcome
from router.policy import DecodeCandidate, Route, RouterPolicy, choose_decode, decide_route
from router.router import _Timings

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


def test_stage_timings_add_up_to_ttft_on_every_route() -> None:
    stages = ("route_ms", "decode_allocate_ms", "prefill_queued_ms", "prefill_compute_ms",
              "kv_transfer_ms", "handoff_ms", "remote_attempt_ms", "local_prefill_ms")

    def total(t: dict[str, float]) -> float:
        return sum(t.get(k, 0.0) for k in stages)

    remote = _Timings(time.monotonic())
    remote.routed()
    remote.allocated()
    time.sleep(0.005)
    remote.prefilled(PrefillOutcome("p", 0.5, 1.0, 0.5, 1, 1))
    remote.first_token()
    t = remote.finish()
    assert total(t) == pytest.approx(t["ttft_ms"]) and t["handoff_ms"] > 0
    assert t["ttft_ms"] <= t["total_ms"]

    # Fell back, then the decode worker went away and a second placement ran locally: the
    # first attempt counts as routing, never as a negative stage.
    retried = _Timings(time.monotonic())
    retried.routed()
    retried.allocated()
    retried.fell_back()
    retried.routed()
    retried.first_token()
    t = retried.finish()
    assert set(t) == {"route_ms", "local_prefill_ms", "ttft_ms", "total_ms"}
    assert min(t.values()) >= 0 and total(t) == pytest.approx(t["ttft_ms"])
