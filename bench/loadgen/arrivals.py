"""Open-loop arrival times."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds from the start of the run at which each request is sent.

    Inter-arrivals are gamma-distributed with shape `burstiness` and mean 1/rate, as in vLLM's
    benchmark_serving: burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular.
    The first request goes out at t=0. The draws do not depend on `rate` (it only scales
    them), so runs at different rates see the same arrival pattern, stretched.
    """
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, 2])
    gaps = rng.standard_gamma(burstiness, size=num_requests - 1) / (burstiness * rate)
    return np.concatenate(([0.0], np.cumsum(gaps)))
