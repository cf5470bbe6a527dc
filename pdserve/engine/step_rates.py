"""What an engine's steps are measured to do, as moving averages: the inputs of the router's
cost model (router.cost), published in the worker's load record. Plain Python, no torch."""

from __future__ import annotations


class StepRates:
    """EWMAs over steps: prompt tokens per second in steps that prefilled at least
    `min_prefill_tokens` (their decode rows ride along and are part of the price), and the
    seconds of a step that prefilled nothing (what a running stream pays per token). 0.0 means
    no sample yet.

    With each prefill rate sample, the share of its CPUs the engine had during the step (its
    CPU seconds over wall seconds x threads, `prefill_cpu_share`): a rate measured while
    other processes took its CPUs (a prefill worker at a lower priority beside busy decode
    workers) is not its speed on free CPUs, and the router's cost model must know which it
    was before it scales the rate to the CPUs it will find (router.cost.cpu_factor)."""

    def __init__(self, *, alpha: float = 0.2, min_prefill_tokens: int = 32):
        self.alpha = alpha
        self.min_prefill_tokens = min_prefill_tokens
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        self.prefill_cpu_share = 0.0

    def observe(self, seconds: float, prefill_tokens: int,
                cpu_seconds: float | None = None) -> None:
        """A step of `seconds` (wall) that prefilled `prefill_tokens`; `cpu_seconds`: the CPU
        time it got per thread of its own (None: not measured)."""
        if seconds <= 0.0:
            return
        if prefill_tokens >= self.min_prefill_tokens:
            self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s,
                                                   prefill_tokens / seconds)
            if cpu_seconds is not None:
                share = min(1.0, max(0.01, cpu_seconds / seconds))
                self.prefill_cpu_share = self._ewma(self.prefill_cpu_share, share)
        elif prefill_tokens == 0:
            self.decode_step_s = self._ewma(self.decode_step_s, seconds)

    def _ewma(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)
