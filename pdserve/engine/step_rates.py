"""What an engine's steps are measured to do, as moving averages: the inputs of the router's
cost model (router.cost), published in the worker's load record. Plain Python, no torch."""

from __future__ import annotations


class StepRates:
    """EWMAs over steps: prompt tokens per second in steps that prefilled at least
    `min_prefill_tokens` (their decode rows ride along and are part of the price), and the
    seconds of a step that prefilled nothing (what a running stream pays per token). 0.0 means
    no sample yet."""

    def __init__(self, *, alpha: float = 0.2, min_prefill_tokens: int = 32):
        self.alpha = alpha
        self.min_prefill_tokens = min_prefill_tokens
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        if seconds <= 0.0:
            return
        if prefill_tokens >= self.min_prefill_tokens:
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s,
                                                   prefill_tokens / seconds)
        elif prefill_tokens == 0:
            self.decode_step_s = self._ewma(self.decode_step_s, seconds)

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)
