"""Local vs remote prefill by predicted cost (router.cost), and placement with it."""

from __future__ import annotations

import time

from pdserve.control.load import WorkerLoad
from pdserve.control.workers import WorkerInfo
from pdserve.types import LatencyClass
from router.cost import CostModel, decide_by_cost, local_estimate, remote_estimate
from router.kv_index import KVIndex
from router.placement import place
from router.policy import Route, RouterPolicy

MODEL = CostModel()
DECODE = WorkerLoad(running=8, prefill_tokens_per_s=1000.0, decode_step_s=0.03)
PREFILL = WorkerLoad(prefill_tokens_per_s=1500.0, kv_transfer_s_per_token=1e-5)


def _route(decode: WorkerLoad, prefill: WorkerLoad | None, uncached: int,
           target_s: float = 30.0, **inflight: float) -> Route:
    local = local_estimate(decode, uncached, MODEL, inflight_tokens=inflight.get("local", 0))
    remote = None if prefill is None else remote_estimate(
        prefill, decode, uncached, MODEL, inflight_tokens=inflight.get("remote", 0))
    return decide_by_cost(local, remote, uncached, target_s, MODEL)[0].route


def test_long_prompts_leave_a_busy_decode_worker_short_ones_stay() -> None:
    assert _route(DECODE, PREFILL, 2000) is Route.REMOTE  # 8 streams would stall 2 s each
    assert _route(DECODE, PREFILL, 8) is Route.LOCAL  # the hand-off costs more than 8 tokens
    assert _route(DECODE, None, 2000) is Route.LOCAL


def test_an_idle_decode_worker_prefills_itself_when_the_pool_is_backed_up() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    backed_up = WorkerLoad(queued_tokens=30000, prefill_tokens_per_s=1500.0)
    assert _route(idle, backed_up, 2000, target_s=10.0) is Route.LOCAL  # remote: ~21 s
    assert _route(idle, PREFILL, 2000) is Route.REMOTE  # faster pool, nothing queued there


def test_in_flight_tokens_count_before_the_next_heartbeat() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0)
    assert _route(idle, PREFILL, 2000) is Route.REMOTE
    # A burst went there: remote would take ~28 s.
    assert _route(idle, PREFILL, 2000, target_s=10.0, remote=40000) is Route.LOCAL


def test_the_target_decides_when_only_one_route_meets_it() -> None:
    # Remote is cheaper overall (no stall) but misses a tight target that local meets.
    slow_pool = WorkerLoad(queued_tokens=3000, prefill_tokens_per_s=1500.0)
    assert _route(DECODE, slow_pool, 1000, target_s=30.0) is Route.REMOTE
    assert _route(DECODE, slow_pool, 1000, target_s=1.5) is Route.LOCAL


def test_priors_stand_in_until_workers_measure() -> None:
    unmeasured = WorkerLoad()
    est = local_estimate(unmeasured, 500, MODEL)
    assert est.ttft_s == 500 / MODEL.prior_prefill_tokens_per_s + MODEL.prior_decode_step_s


def _worker(worker_id: str, role: str, load: WorkerLoad) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address="127.0.0.1:1",  # type: ignore[arg-type]
                      model_id="m", epoch=1, started_at=time.time(), load=load)


def test_placement_with_the_cost_policy() -> None:
    decoders = [_worker("d0", "decode", DECODE)]
    prefills = [_worker("p0", "prefill", WorkerLoad(queued_tokens=50000,
                                                    prefill_tokens_per_s=1500.0)),
                _worker("p1", "prefill", PREFILL)]
    policy = RouterPolicy(placement="cost")
    p = place(list(range(2000)), LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
              policy)
    assert p.decision.route is Route.REMOTE and p.prefill is not None
    assert p.prefill.worker_id == "p1" and p.decision.reason == "cost_remote"
    assert p.decision.uncached_tokens == 2000
    short = place(list(range(10)), LatencyClass.STANDARD, decoders, prefills, KVIndex(), {},
                  policy)
    assert short.decision.route is Route.LOCAL


def test_a_long_local_prefill_is_taken_only_when_remote_misses_the_target() -> None:
    idle = WorkerLoad(running=0, prefill_tokens_per_s=1000.0, decode_step_s=0.02)
    queued_pool = WorkerLoad(queued_tokens=3000, prefill_tokens_per_s=1000.0)
    # Local would be faster (2 s vs 5 s) and stalls nobody now, but blocks the next arrivals.
    assert _route(idle, queued_pool, 2000, target_s=30.0) is Route.REMOTE
    assert _route(idle, queued_pool, 2000, target_s=3.0) is Route.LOCAL
