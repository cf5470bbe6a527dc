"""Admission control: refuse a request early when it cannot get its first token in time.

The router is the cluster's one entry point, so it knows every request it has admitted that has
not produced its first token yet ("pending") and the prompt tokens they carry. A new request's
wait is predicted as the work ahead of it divided by the rate the cluster has been delivering
first tokens at:

    predicted_wait_s = (pending work ahead + prefill workers' other queued tokens) / work_rate

"Ahead" follows the workers' schedulers, which serve the more urgent latency class first: an
interactive request waits only for pending interactive work, a batch request for all of it.
Prefill workers' queued tokens count past what this router has in flight there
(`external_backlog`: another router's work, whose class it does not know).
A request's work is its prompt tokens plus `request_overhead_tokens` (a short prompt still
costs a pass). `work_rate` starts from the predictor placement uses (router.cost): the
cluster's prefill capacity, the sum of each worker's measured prefill rate from its
heartbeats, with the cost model's conservative prior (250 tokens/s) for a worker that has
measured nothing yet, so a cold cluster does not admit a burst it cannot serve in time. Once
`min_samples` first tokens were observed, the rate is what the router observes: each first
token gives one sample, (work that was ahead at admission + own work) / observed TTFT, folded
into an EWMA that starts from the capacity estimate (it also sees what capacity cannot:
prefix-cache hits, batching).

Rules, in order (`AdmissionController.decide`):
1. Hard cap: at most `max_in_flight` requests (admitted, not finished) per router; this bounds
   the router's queues and memory. Lower classes get a smaller share of it
   (`class_share`), so batch is shed before standard, standard before interactive.
2. An empty queue always admits (nothing is ahead: predicting from a slow sample would refuse
   work an idle cluster can do).
3. Otherwise admit only if predicted_wait_s <= the class's TTFT deadline.

A refusal is an `OverloadedError` (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED). The
controller is plain Python and holds no locks: the router calls it from one event loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pdserve.errors import OverloadedError
from pdserve.types import LatencyClass

# Interactive chat wants a first token within seconds; batch jobs tolerate minutes. Generous
# enough that an unloaded cluster on a small CPU machine never refuses.
DEFAULT_TTFT_DEADLINES_S: Mapping[LatencyClass, float] = MappingProxyType({
    LatencyClass.INTERACTIVE: 10.0, LatencyClass.STANDARD: 30.0, LatencyClass.BATCH: 120.0})
# Share of `max_in_flight` each class may fill: the lower classes hit their cap first.
DEFAULT_CLASS_SHARE: Mapping[LatencyClass, float] = MappingProxyType({
    LatencyClass.INTERACTIVE: 1.0, LatencyClass.STANDARD: 0.9, LatencyClass.BATCH: 0.75})


def external_backlog(queued: Iterable[tuple[str, float]], own: Mapping[str, float]) -> float:
    """Prompt tokens prefill workers queue that this router did not send them (another
    router's work), from each worker's (id, queued tokens) and what this router has in flight
    there (its ledger): its own is in the controller's pending work already, by class.
    Counted in full, a router's own batch prompts queued at a prefill worker made every
    interactive prompt wait for them in the prediction, though it would not wait for them
    where it is served (docs/bench/placement_s63/flood: a batch flood on 1P1D refused all
    ten interactive prompts)."""
    return sum(max(0.0, q - own.get(w, 0.0)) for w, q in queued)


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True
    max_in_flight: int = 256  # per router: admitted and not finished
    ttft_deadlines_s: Mapping[LatencyClass, float] = field(
        default_factory=lambda: DEFAULT_TTFT_DEADLINES_S)
    class_share: Mapping[LatencyClass, float] = field(default_factory=lambda: DEFAULT_CLASS_SHARE)
    request_overhead_tokens: int = 64
    # Until the first sample, when the caller gives no capacity (no worker registered).
    initial_rate_tokens_per_s: float = 250.0
    min_rate_tokens_per_s: float = 1.0
    rate_ewma_alpha: float = 0.2
    # First tokens observed before the observed rate replaces the workers' measured capacity.
    min_samples: int = 4
    # An admitted request that has no first token after deadline * this fails with a
    # retryable error (503 + Retry-After) instead of waiting for the stage timeouts. At 1 a
    # request is answered within its class's deadline or refused (`--deadline-factor 1`); the
    # default lets a late answer finish, up to 4x the deadline.
    first_token_deadline_factor: float = 4.0
    min_retry_after_s: int = 1
    max_retry_after_s: int = 60

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.min_samples < 0:
            raise ValueError("min_samples must be >= 0")
        object.__setattr__(self, "ttft_deadlines_s",
                           MappingProxyType({**DEFAULT_TTFT_DEADLINES_S, **self.ttft_deadlines_s}))
        object.__setattr__(self, "class_share",
                           MappingProxyType({**DEFAULT_CLASS_SHARE, **self.class_share}))
        for cls, s in self.ttft_deadlines_s.items():
            if not (s > 0 and math.isfinite(s)):
                raise ValueError(f"TTFT deadline of {cls.value} must be > 0, got {s}")
        for cls, share in self.class_share.items():
            if not 0 < share <= 1:
                raise ValueError(f"class share of {cls.value} must be in (0, 1], got {share}")
        if not 0 < self.rate_ewma_alpha <= 1 or self.initial_rate_tokens_per_s <= 0 \
                or self.min_rate_tokens_per_s <= 0 or self.first_token_deadline_factor <= 0:
            raise ValueError("admission rates, alpha and deadline factor must be > 0")

    def deadline_s(self, latency_class: LatencyClass) -> float:
        return self.ttft_deadlines_s[latency_class]

    def cap(self, latency_class: LatencyClass) -> int:
        return max(1, int(self.max_in_flight * self.class_share[latency_class]))


@dataclass
class Ticket:
    """One admitted request; hand it back to `first_token` and `release`."""

    latency_class: LatencyClass
    work: float  # tokens charged
    ahead: float  # work pending when it was admitted
    admitted_at: float
    predicted_wait_s: float
    pending: bool = True  # no first token yet
    released: bool = False


@dataclass
class AdmissionController:
    """`rate_tokens_per_s`: a fixed starting rate (tests); without one, the rate comes from
    the capacity the caller passes to `decide` until `min_samples` first tokens, then from
    the samples alone."""

    config: AdmissionConfig = field(default_factory=AdmissionConfig)
    rate_tokens_per_s: float = 0.0
    in_flight: int = 0
    pending: int = 0
    samples: int = 0  # first tokens observed
    capacity_tokens_per_s: float | None = None  # the last capacity `decide` was given
    _pending_work: dict[LatencyClass, float] = field(default_factory=dict)
    _calibrating: bool = True  # no fixed rate: capacity first, then samples

    def __post_init__(self) -> None:
        if self.rate_tokens_per_s > 0:
            self._calibrating = False
        else:
            self.rate_tokens_per_s = self.config.initial_rate_tokens_per_s
        self._pending_work = dict.fromkeys(LatencyClass, 0.0)

    @property
    def rate(self) -> float:
        """The work rate predictions use now (see the module doc)."""
        if (self._calibrating and self.capacity_tokens_per_s is not None
                and self.samples < self.config.min_samples):
            return max(self.config.min_rate_tokens_per_s, self.capacity_tokens_per_s)
        return self.rate_tokens_per_s

    @property
    def pending_work(self) -> float:
        return sum(self._pending_work.values())

    def work_ahead(self, latency_class: LatencyClass) -> float:
        """Pending work a new request of `latency_class` waits for: its class and the more
        urgent ones."""
        return sum(w for c, w in self._pending_work.items()
                   if c.priority <= latency_class.priority)

    def work_of(self, prompt_tokens: int) -> float:
        return float(prompt_tokens + self.config.request_overhead_tokens)

    def predicted_wait_s(self, latency_class: LatencyClass = LatencyClass.BATCH,
                         external_backlog_tokens: float = 0.0) -> float:
        return (self.work_ahead(latency_class) + external_backlog_tokens) / self.rate

    def decide(self, latency_class: LatencyClass, prompt_tokens: int, now: float,
               external_backlog_tokens: float = 0.0,
               capacity_tokens_per_s: float | None = None) -> Ticket:
        """Admit (a Ticket) or raise OverloadedError. `external_backlog_tokens`: work queued
        where the router does not see it (prefill workers' queued tokens);
        `capacity_tokens_per_s`: the cluster's prefill rate as router.cost predicts it."""
        cfg = self.config
        if capacity_tokens_per_s is not None:
            self.capacity_tokens_per_s = capacity_tokens_per_s
        work = self.work_of(prompt_tokens)
        ahead = self.work_ahead(latency_class) + external_backlog_tokens
        wait = ahead / self.rate
        deadline = cfg.deadline_s(latency_class)
        if cfg.enabled:
            if self.in_flight >= cfg.cap(latency_class):
                raise OverloadedError(
                    f"the router is at its limit of {cfg.cap(latency_class)} in-flight "
                    f"{latency_class.value} requests", reason="in_flight_cap",
                    latency_class=latency_class.value,
                    retry_after_s=self._retry_after(wait, deadline))
            if ahead > 0 and wait > deadline:
                raise OverloadedError(
                    f"predicted wait for a first token {wait:.1f} s exceeds the "
                    f"{latency_class.value} deadline of {deadline:g} s", reason="deadline",
                    latency_class=latency_class.value,
                    retry_after_s=self._retry_after(wait, deadline))
        ticket = Ticket(latency_class, work, ahead, now, wait)
        self.in_flight += 1
        self.pending += 1
        self._pending_work[latency_class] += work
        return ticket

    def first_token(self, ticket: Ticket, now: float) -> None:
        """The request produced its first token: its work is done; learn the rate from it."""
        if not ticket.pending:
            return
        self._unpend(ticket)
        ttft = now - ticket.admitted_at
        if ttft > 0:
            sample = (ticket.ahead + ticket.work) / ttft
            a = self.config.rate_ewma_alpha
            if self._calibrating and self.samples == 0 and self.capacity_tokens_per_s:
                # The average starts from the capacity estimate, not a made-up rate; one
                # sample (maybe a cold first request) only moves it by alpha.
                self.rate_tokens_per_s = self.capacity_tokens_per_s
            self.samples += 1
            self.rate_tokens_per_s = max(self.config.min_rate_tokens_per_s,
                                         (1 - a) * self.rate_tokens_per_s + a * sample)

    def release(self, ticket: Ticket) -> None:
        """The request ended, however it ended. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.pending:
            self._unpend(ticket)
        self.in_flight -= 1

    def _unpend(self, ticket: Ticket) -> None:
        ticket.pending = False
        self.pending -= 1
        c = ticket.latency_class
        self._pending_work[c] = max(0.0, self._pending_work[c] - ticket.work)

    def _retry_after(self, wait_s: float, deadline_s: float) -> int:
        """Roughly when the excess work ahead will have drained."""
        cfg = self.config
        excess = max(0.0, wait_s - deadline_s)
        return int(min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, math.ceil(excess))))


def parse_deadlines(specs: list[str] | tuple[str, ...]) -> dict[LatencyClass, float]:
    """CLASS=SECONDS items (`--ttft-deadline interactive=5`) -> a deadline table."""
    out: dict[LatencyClass, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            cls = LatencyClass(name.strip())
            seconds = float(value)
        except ValueError:
            raise ValueError(f"expected CLASS=SECONDS with CLASS one of "
                             f"{', '.join(c.value for c in LatencyClass)}, got {spec!r}") from None
        if not sep or not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"expected CLASS=SECONDS with SECONDS > 0, got {spec!r}")
        out[cls] = seconds
    return out


__all__ = [
    "DEFAULT_TTFT_DEADLINES_S",
    "AdmissionConfig",
    "AdmissionController",
    "Ticket",
    "parse_deadlines",
]
