"""A remote prefill's lease (router.remote.prefill_lease_s): the decode worker's hold on the
blocks its KV goes to covers the prefill worker's queue ahead of it, so a prompt that waits its
turn is not thrown away and prefilled again on the decode worker; each part of the KV that
lands renews it, so the prefill call and the KV wait run to `progress_cap_s`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.control.load import WorkerLoad
from pdserve.types import FinishReason, GenerateRequest, SamplingParams, TokenEvent
from router.config import RouterConfig
from router.cost import CostModel
from router.remote import (
    LEASE_HEADROOM,
    RemoteTimeouts,
    prefill_lease_s,
    prefill_wait_s,
    progress_cap_s,
    remote_prefill,
)
from router.timings import StageClock

TIMEOUTS = RemoteTimeouts(prefill_timeout_s=30.0, max_prefill_timeout_s=120.0)


def test_a_short_queue_keeps_the_configured_timeout() -> None:
    assert prefill_lease_s(TIMEOUTS, None) == 30.0  # the worker measured no rate yet
    assert prefill_lease_s(TIMEOUTS, 5.0) == 30.0
    assert prefill_lease_s(TIMEOUTS, 30.0 / LEASE_HEADROOM) == 30.0


def test_a_longer_queue_stretches_the_lease_up_to_its_ceiling() -> None:
    assert prefill_lease_s(TIMEOUTS, 40.0) == pytest.approx(40.0 * LEASE_HEADROOM)
    assert prefill_lease_s(TIMEOUTS, 500.0) == 120.0
    # A ceiling set under the timeout never shortens it.
    low = RemoteTimeouts(prefill_timeout_s=30.0, max_prefill_timeout_s=10.0)
    assert prefill_lease_s(low, 500.0) == 30.0


def test_the_wait_is_the_larger_of_the_published_queue_and_what_this_router_sent() -> None:
    load = WorkerLoad(queued_tokens=4000.0, waiting_prompt_tokens=1000.0,
                      prefill_tokens_per_s=250.0)
    assert prefill_wait_s(load, 0.0, 250.0) == pytest.approx(20.0)  # (4000 + 1000) / 250
    assert prefill_wait_s(load, 10000.0, 250.0) == pytest.approx(40.0)  # sent since


def test_a_cold_prefill_workers_queue_is_leased_at_the_slow_prior() -> None:
    """A prefill worker that has measured no rate yet: its queue is priced at a peer's rate,
    else the cost model's slow prior, so a burst on a cold cluster is not cut off at the
    shortest lease (the router, `Router._prefill_wait_s`)."""
    cold = WorkerLoad()
    model = CostModel()
    wait = prefill_wait_s(cold, 20000.0, model.prefill_rate(cold, None))
    assert wait == pytest.approx(20000.0 / model.prior_prefill_tokens_per_s)
    assert prefill_lease_s(TIMEOUTS, wait) > TIMEOUTS.prefill_timeout_s
    assert prefill_wait_s(cold, 20000.0, model.prefill_rate(cold, 2000.0)) == 10.0  # a peer's


def test_the_routers_settings_reach_the_remote_timeouts() -> None:
    cfg = RouterConfig(prefill_timeout_s=20.0, max_prefill_timeout_s=90.0)
    assert (cfg.remote.prefill_timeout_s, cfg.remote.max_prefill_timeout_s) == (20.0, 90.0)
    assert RouterConfig().remote.max_prefill_timeout_s == 120.0


def test_a_prefill_that_keeps_landing_may_run_to_the_cap() -> None:
    assert progress_cap_s(TIMEOUTS, 30.0) == 120.0
    assert progress_cap_s(TIMEOUTS, 150.0) == 150.0  # never under the lease itself


class _Lost:
    """Liveness as remote_prefill uses it: nobody is ever lost here."""

    def lost_future(self, worker_id: str) -> asyncio.Future[None]:
        return asyncio.get_running_loop().create_future()


async def test_the_decode_worker_renews_the_lease_the_router_waits_to_the_cap() -> None:
    """The lease asked of the decode worker is the prediction's (the first part's deadline,
    renewed by each part that lands); the prefill call and the KV wait run to the cap, so a
    prefill that keeps making progress is only cut off by the decode worker's lease, or the
    request's own first-token budget."""
    seen: dict[str, float] = {}

    class Remote:
        async def allocation(self) -> str:
            return "slot"

        async def events(self) -> AsyncIterator[TokenEvent]:
            yield TokenEvent("r", 7, finish_reason=FinishReason.LENGTH)

        def close(self) -> None:
            pass

    class Decode:
        worker_id = "decode-0"

        def generate_remote(self, req: GenerateRequest, **kw: float) -> Remote:
            seen.update(kw)
            return Remote()

    class Prefill:
        worker_id = "prefill-0"

        async def prefill(self, req: GenerateRequest, slot: str, timeout_s: float) -> None:
            seen["prefill_timeout_s"] = timeout_s

    req = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=1))

    async def run(**kw: float | None) -> dict[str, float]:
        seen.clear()
        events = [ev async for ev in remote_prefill(
            req, Decode(), Prefill(), StageClock(0.0), timeouts=TIMEOUTS,  # type: ignore[arg-type]
            liveness=_Lost(), abort_on=lambda *_: None, timed=False, **kw)]  # type: ignore[arg-type]
        assert [ev.token_id for ev in events] == [7]
        return dict(seen)

    got = await run(expected_s=40.0)
    assert got["lease_s"] == pytest.approx(60.0)  # 1.5x the prediction
    assert got["prefill_timeout_s"] == 120.0
    assert got["transfer_timeout_s"] == 120.0 + TIMEOUTS.transfer_timeout_s
    got = await run(expected_s=None, budget_s=20.0)  # the request's first-token budget
    assert (got["lease_s"], got["prefill_timeout_s"], got["transfer_timeout_s"]) == (20, 20, 20)
