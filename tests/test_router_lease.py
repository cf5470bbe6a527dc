"""A remote prefill's lease (router.remote.prefill_lease_s): the prefill call's deadline and the
decode worker's hold on the blocks its KV goes to cover the prefill worker's queue ahead of it,
so a prompt that waits its turn is not thrown away and prefilled again on the decode worker."""

from __future__ import annotations

import pytest

from pdserve.control.load import WorkerLoad
from router.config import RouterConfig
from router.remote import LEASE_HEADROOM, RemoteTimeouts, prefill_lease_s, prefill_wait_s

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
    assert prefill_wait_s(load, 0.0) == pytest.approx(20.0)  # (4000 + 1000) / 250
    assert prefill_wait_s(load, 10000.0) == pytest.approx(40.0)  # sent since its heartbeat
    assert prefill_wait_s(WorkerLoad(queued_tokens=4000.0), 10000.0) is None  # no rate


def test_the_routers_settings_reach_the_remote_timeouts() -> None:
    cfg = RouterConfig(prefill_timeout_s=20.0, max_prefill_timeout_s=90.0)
    assert (cfg.remote.prefill_timeout_s, cfg.remote.max_prefill_timeout_s) == (20.0, 90.0)
    assert RouterConfig().remote.max_prefill_timeout_s == 120.0
