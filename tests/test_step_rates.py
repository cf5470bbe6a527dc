"""The engine's measured step costs (pdserve.engine.step_rates) as its load record publishes
them: the prefill rate with the share of its CPUs it had while it measured."""

from __future__ import annotations

import pytest

from pdserve.control.load import WorkerLoad
from pdserve.engine.metrics import engine_load
from pdserve.engine.step_rates import StepRates
from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, run_to_end


def test_the_cpu_share_is_averaged_with_the_prefill_rate() -> None:
    rates = StepRates(alpha=0.5)
    rates.observe(1.0, 500)  # not measured: the share stays unknown
    assert (rates.prefill_tokens_per_s, rates.prefill_cpu_share) == (500.0, 0.0)
    rates.observe(2.0, 500, cpu_seconds=0.5)  # a quarter of its CPU
    assert rates.prefill_cpu_share == 0.25
    rates.observe(1.0, 500, cpu_seconds=1.2)  # more than the wall: all of it, no more
    assert rates.prefill_cpu_share == pytest.approx(0.625)
    rates.observe(1.0, 0, cpu_seconds=0.1)  # a decode step: not a prefill sample
    assert rates.prefill_cpu_share == pytest.approx(0.625)
    assert rates.decode_step_s == 1.0


def test_a_real_engine_publishes_the_share_it_prefilled_with(make_engine, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """Alone on its CPUs (the test's), a step gets most of them; the load record the worker
    publishes carries it for the router (router.cost.cpu_factor)."""
    engine = make_engine()
    run_to_end(engine, [GenerateRequest("a", tuple(prompt_ids[-1]), greedy(4))])
    stats = engine.stats()
    assert 0.0 < stats.prefill_cpu_share <= 1.0
    load = WorkerLoad.from_dict(engine_load(stats))
    assert load.prefill_cpu_share == stats.prefill_cpu_share
    assert WorkerLoad.from_dict(load.to_dict()) == load
