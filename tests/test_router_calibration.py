"""Cost placement's fixed cost of a remote prefill learned from the allocation + hand-off
measured on remote requests (router.calibration). The router and the simulator feeding it:
tests/test_cluster_cost.py, tests/test_cluster_sim.py."""

from __future__ import annotations

import pytest

from router.calibration import RemoteOverhead
from router.cost import CostModel

BASE = CostModel()  # remote_overhead_s 0.02
STEP = 0.05  # the decode step placement priced with


def test_no_correction_until_enough_remote_requests() -> None:
    learn = RemoteOverhead(window=8, min_samples=4)
    for _ in range(3):
        learn.observe(0.13, STEP, BASE)  # 60 ms more than 20 ms + a 50 ms step
    assert learn.offset_s == 0.0
    assert learn.apply(BASE).remote_overhead_s == BASE.remote_overhead_s
    learn.observe(0.13, STEP, BASE)
    assert learn.offset_s == pytest.approx(0.06)
    assert learn.apply(BASE).remote_overhead_s == pytest.approx(0.08)


def test_the_median_ignores_a_few_long_waits_and_the_window_forgets() -> None:
    learn = RemoteOverhead(window=9, min_samples=5)
    for miss in (0.01, 0.02, 0.03, 1.5, 3.0):  # two allocations behind a long prompt's step
        learn.observe(0.07 + miss, STEP, BASE)
    assert learn.offset_s == pytest.approx(0.03)
    for _ in range(9):  # the deployment changed: every hand-off is now 40 ms faster
        learn.observe(0.03, STEP, BASE)
    assert learn.offset_s == pytest.approx(-0.04)
    assert learn.samples == 9


def test_the_correction_is_bounded() -> None:
    learn = RemoteOverhead(window=4, min_samples=2, limit_s=0.25)
    for _ in range(4):
        learn.observe(10.0, STEP, BASE)
    assert learn.offset_s == 0.25
    for _ in range(4):
        learn.observe(0.0, 2.0, BASE)
    assert learn.offset_s == -0.25


def test_the_miss_is_against_the_configured_model_and_the_step_it_priced() -> None:
    """What is measured is compared with the configured fixed cost plus the decode step the
    placement priced, never with a model that already carries the correction: the same
    measurement keeps the same correction however often it is seen."""
    learn = RemoteOverhead(window=16, min_samples=2)
    for step in (0.03, 0.08) * 20:
        learn.observe(BASE.remote_overhead_s + step + 0.05, step, BASE)
    assert learn.offset_s == pytest.approx(0.05)
    used = learn.apply(BASE)
    assert used.remote_overhead_s == pytest.approx(BASE.remote_overhead_s + 0.05)
    assert learn.apply(BASE) is used  # an unchanged correction: the same model, not a new one
    learn.observe(BASE.remote_overhead_s + 0.03 + 0.0505, 0.03, BASE)  # < 1 ms away
    assert learn.apply(BASE) is used


def test_bad_windows_are_refused() -> None:
    for kw in ({"window": 0}, {"window": 4, "min_samples": 5}, {"limit_s": -1.0}):
        with pytest.raises(ValueError):
            RemoteOverhead(**kw)  # type: ignore[arg-type]
