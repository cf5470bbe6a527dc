"""Running load: one bounded run (`run_load`) and a sweep over request rates (`sweep`)."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import httpx
from tqdm import tqdm

from bench.loadgen.arrivals import arrival_times
from bench.loadgen.client import Trace, discover_model, make_client, stream_request
from bench.loadgen.config import RunConfig
from bench.loadgen.errors import ConfigError, TargetError
from bench.loadgen.metrics import Goodput, RequestResult, RunSummary, goodput, summarize
from bench.loadgen.prompts import Tokenizer, load_tokenizer
from bench.loadgen.workload import RequestSpec, build_requests

_WARMUP_SEED_OFFSET = 1_000_003  # warmup prompts must differ from measured ones (prefix caches)


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    model: str
    started_at: float  # Unix time
    requests: tuple[RequestResult, ...]
    summary: RunSummary


@dataclass(frozen=True)
class SweepResult:
    label: str
    config: RunConfig  # the shared config; each run's own `config.rate` differs
    runs: tuple[RunResult, ...]  # ascending rate
    goodput: Goodput

    @property
    def rates(self) -> list[float]:
        return [run.config.rate for run in self.runs]


async def run_load(
    config: RunConfig,
    *,
    tokenizer: Tokenizer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: bool = False,
    desc: str | None = None,
) -> RunResult:
    """Send `config.num_requests` requests (or fewer if `max_duration_s` runs out) and
    measure them. Never raises for failed requests; they are reported as errors."""
    if tokenizer is None and config.tokenizer_path is not None:
        tokenizer = load_tokenizer(config.tokenizer_path)
    specs = build_requests(config.workload, config.num_requests, config.seed, tokenizer)
    async with make_client(config, transport) as client:
        model = config.model or await discover_model(client, config.url)
        if config.warmup_requests:
            await _warmup(client, config, model, tokenizer)
        started_at = time.time()
        traces, duration = await _drive(client, config, model, specs, progress, desc)
    results = tuple(sorted((t.result() for t in traces), key=lambda r: r.index))
    summary = summarize(results, config.slo, duration, num_unsent=len(specs) - len(traces))
    return RunResult(config, model, started_at, results, summary)


async def sweep(
    config: RunConfig,
    rates: Sequence[float],
    *,
    label: str = "",
    tokenizer: Tokenizer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: bool = False,
    cooldown_s: float = 0.0,
    fresh_prompts: bool = False,
    raise_until_below: int = 0,
    lower_until_met: int = 0,
    growth: float = 1.5,
    min_seconds: float = 0.0,
) -> SweepResult:
    """One open-loop run per rate (ascending), same workload and seed each time; warmup
    requests, if any, are sent only before the first rate.

    `fresh_prompts`: the i-th rate uses seed + i instead, so no prompt repeats across rates;
    otherwise a server's prefix cache serves every rate after the first from memory.
    `raise_until_below`: while the highest rate run still meets the SLO target, run the next
    one at `growth` x that rate, at most this many more times: a sweep that stops before a
    system breaks cannot rank it against another.
    `lower_until_met`: while no run has met the SLO target, run the next one at the lowest
    rate / `growth`, at most this many more times, so a system that misses its SLOs at the
    lowest planned rate still gets a goodput. It stops early when a lower rate did not raise
    the attainment: what misses the SLOs then is not the load (e.g. an unloaded TTFT above
    the bound), and a lower rate would only take longer to say so.
    The runs come back in ascending rate, whatever order they ran in.
    `min_seconds`: each rate sends at least rate x this many requests, so a high rate is
    held that long instead of being a burst of `num_requests` that a latency SLO of seconds
    can absorb in a queue (the system then "meets" a rate it cannot sustain).
    """
    if config.closed_loop:
        raise ConfigError("a rate sweep needs open-loop arrivals; unset concurrency")
    if not rates:
        raise ConfigError("a sweep needs at least one rate")
    if tokenizer is None and config.tokenizer_path is not None:
        tokenizer = load_tokenizer(config.tokenizer_path)
    runs: list[RunResult] = []
    planned = sorted(set(rates))
    rates_to_run = _rates(planned, runs, config.slo.target, raise_until_below, lower_until_met,
                          growth)
    for i, rate in enumerate(rates_to_run):
        if i and cooldown_s > 0:
            await asyncio.sleep(cooldown_s)
        run_config = config.with_rate(rate)
        held = math.ceil(rate * min_seconds - 1e-9)
        if held > config.num_requests:
            run_config = replace(run_config, num_requests=held)
        if fresh_prompts:
            run_config = replace(run_config, seed=config.seed + i)
        if runs:
            run_config = replace(run_config, model=runs[0].model, warmup_requests=0)
        desc = f"{label + ' ' if label else ''}rate={rate:g}"
        runs.append(
            await run_load(
                run_config, tokenizer=tokenizer, transport=transport, progress=progress, desc=desc
            )
        )
    runs.sort(key=lambda run: run.config.rate)
    points = [(run.config.rate, _attainment(run)) for run in runs]
    return SweepResult(label, config, tuple(runs), goodput(points, config.slo.target))


def _attainment(run: RunResult) -> float:
    return run.summary.overall.attainment.both


def _rates(planned: list[float], runs: list[RunResult], target: float, raise_n: int,
           lower_n: int, growth: float) -> Iterator[float]:
    """The planned rates; then higher ones while the last run met `target`; then, if none
    met it, lower ones while that helps (see `sweep`). Reads `runs` as the sweep appends."""
    yield from planned
    for _ in range(raise_n):
        if not runs or _attainment(runs[-1]) < target:
            break
        yield round(runs[-1].config.rate * growth, 3)
    above: float | None = None  # the attainment of the lowest rate before the last step down
    for _ in range(lower_n):
        if not runs or any(_attainment(run) >= target for run in runs):
            return
        lowest = min(runs, key=lambda run: run.config.rate)
        if above is not None and _attainment(lowest) <= above:
            return
        above = _attainment(lowest)
        lower = round(lowest.config.rate / growth, 3)
        if lower <= 0:
            return
        yield lower


async def _warmup(
    client: httpx.AsyncClient, config: RunConfig, model: str, tokenizer: Tokenizer | None
) -> None:
    specs = build_requests(
        config.workload, config.warmup_requests, config.seed + _WARMUP_SEED_OFFSET, tokenizer
    )
    for spec in specs:
        trace = Trace(spec, time.perf_counter())
        await stream_request(client, config, model, trace)
        error = trace.result().error
        if error is not None:
            raise TargetError(f"warmup request to {config.endpoint} failed: {error}")


async def _drive(
    client: httpx.AsyncClient,
    config: RunConfig,
    model: str,
    specs: list[RequestSpec],
    progress: bool,
    desc: str | None,
) -> tuple[list[Trace], float]:
    """Send the requests open- or closed-loop until done or the deadline; returns the traces
    of the requests that were sent and the measured duration."""
    traces: list[Trace] = []
    num_errors = 0
    bar = tqdm(
        total=len(specs),
        desc=desc,
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    start = time.perf_counter()

    async def one(spec: RequestSpec) -> float:
        """Send `spec`; returns the Retry-After of a refusal in seconds, else 0."""
        nonlocal num_errors
        if limit is not None:
            await limit.acquire()
        trace = Trace(spec, start)
        traces.append(trace)
        try:
            await stream_request(client, config, model, trace)
        finally:
            if limit is not None:
                limit.release()
        result = trace.result()
        if not result.ok:
            num_errors += 1
            bar.set_postfix(errors=num_errors, refresh=False)
        bar.update(1)
        return 0.0 if result.ok else result.retry_after_s or 0.0

    async def open_loop() -> None:
        times = arrival_times(len(specs), config.rate, config.burstiness, config.seed)
        async with asyncio.TaskGroup() as group:
            for spec, at in zip(specs, times, strict=True):
                delay = start + float(at) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                group.create_task(one(spec))

    async def closed_loop() -> None:
        pending = iter(specs)  # shared: each worker takes the next unsent request

        async def worker() -> None:
            # A refusal with a Retry-After is waited out before this worker's next request,
            # as a real client (the `openai` one) does: sent at once, the next one would be
            # refused too, and a loop of refusals spends the run's requests in a second.
            for spec in pending:
                if wait_s := min(await one(spec), config.max_retry_after_s):
                    await asyncio.sleep(wait_s)

        async with asyncio.TaskGroup() as group:
            for _ in range(config.concurrency or 1):
                group.create_task(worker())

    try:
        async with asyncio.timeout(config.max_duration_s):
            await (closed_loop() if config.closed_loop else open_loop())
    except TimeoutError:
        pass  # in-flight requests were cancelled; their traces say so
    finally:
        bar.close()
    ends = [t.ended_at for t in traces if t.ended_at is not None]
    duration = (max(ends) if ends else time.perf_counter()) - start
    return traces, duration
