"""Cost placement's first-token predictions corrected by what they missed
(router.calibration). The router and the simulator feeding it: tests/test_cluster_cost.py,
tests/test_cluster_sim.py."""

from __future__ import annotations

import pytest

from router.calibration import TTFTCalibration
from router.cost import CostModel
from router.policy import Route

BASE = CostModel()


def test_no_correction_until_enough_first_tokens() -> None:
    cal = TTFTCalibration(window=8, min_samples=4)
    for _ in range(3):
        cal.observe(Route.REMOTE, 0.2, 0.26)
    assert cal.offset_s(Route.REMOTE) == 0.0
    assert cal.apply(BASE).remote_overhead_s == BASE.remote_overhead_s
    cal.observe(Route.REMOTE, 0.2, 0.26)
    assert cal.offset_s(Route.REMOTE) == pytest.approx(0.06)
    assert cal.offset_s(Route.LOCAL) == 0.0  # each route learns from its own first tokens


def test_the_median_ignores_a_few_long_queues_and_the_window_forgets() -> None:
    cal = TTFTCalibration(window=9, min_samples=5)
    for miss in (0.01, 0.02, 0.03, 4.0, 9.0):  # two bursts the model could not see
        cal.observe(Route.LOCAL, 0.1, 0.1 + miss)
    assert cal.offset_s(Route.LOCAL) == pytest.approx(0.03)
    for _ in range(9):  # the deployment changed: every first token is now 40 ms faster
        cal.observe(Route.LOCAL, 0.1, 0.06)
    assert cal.offset_s(Route.LOCAL) == pytest.approx(-0.04)
    assert cal.samples(Route.LOCAL) == 9


def test_the_correction_is_bounded() -> None:
    cal = TTFTCalibration(window=4, min_samples=2, limit_s=0.25)
    for _ in range(4):
        cal.observe(Route.REMOTE, 0.5, 10.0)
    assert cal.offset_s(Route.REMOTE) == 0.25
    for _ in range(4):
        cal.observe(Route.LOCAL, 5.0, 0.1)
    assert cal.offset_s(Route.LOCAL) == -0.25


def test_the_correction_never_feeds_on_itself() -> None:
    """A prediction made with the correction in it is taken back to the model's own before it
    is compared: the same true miss keeps the same correction, however often it is seen."""
    cal = TTFTCalibration(window=16, min_samples=2)
    for _ in range(50):
        used = cal.apply(BASE)
        predicted = 0.3 + used.remote_overhead_s  # what placement predicts with `used`
        cal.observe(Route.REMOTE, cal.uncorrected(Route.REMOTE, predicted, used),
                    0.3 + BASE.remote_overhead_s + 0.05)
    assert cal.offset_s(Route.REMOTE) == pytest.approx(0.05)
    used = cal.apply(BASE)
    assert used.remote_overhead_s == pytest.approx(BASE.remote_overhead_s + 0.05)
    assert used.local_overhead_s == BASE.local_overhead_s
    assert cal.apply(BASE) is used  # unchanged corrections: the same model, not a new one


def test_a_fallback_teaches_nothing() -> None:
    cal = TTFTCalibration(window=2, min_samples=1)
    cal.observe(Route.FALLBACK, 0.1, 5.0)
    assert cal.offset_s(Route.FALLBACK) == 0.0
    assert cal.samples(Route.LOCAL) == cal.samples(Route.REMOTE) == 0


def test_bad_windows_are_refused() -> None:
    for kw in ({"window": 0}, {"window": 4, "min_samples": 5}, {"limit_s": -1.0}):
        with pytest.raises(ValueError):
            TTFTCalibration(**kw)  # type: ignore[arg-type]
