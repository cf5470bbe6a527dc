"""A remote prefill, seen from the router: one stream on the decode worker (its first message
is the allocation, then the tokens from the KV's arrival on) and one Prefill call to the
prefill worker with that allocation. Any failure before the first token is
`RemotePrefillFailed`, which the router answers by prefilling locally."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from pdserve.control.load import WorkerLoad
from pdserve.errors import CapacityError, ErrorCode, PdserveError, RemotePrefillFailed
from pdserve.types import GenerateRequest, PrefillReport, TokenEvent
from router.clients import DecodeClient, PrefillClient
from router.cost import pending_prefill_tokens
from router.liveness import Liveness
from router.timings import StageClock


@dataclass(frozen=True)
class RemoteTimeouts:
    allocate_timeout_s: float = 5.0
    prefill_timeout_s: float = 30.0
    # The most a queue predicted past prefill_timeout_s stretches it to (`prefill_lease_s`),
    # and the most a remote prefill whose KV keeps landing may take (`progress_cap_s`).
    max_prefill_timeout_s: float = 120.0
    transfer_timeout_s: float = 30.0
    token_timeout_s: float = 60.0  # between two tokens of a running stream
    prefill_report_wait_s: float = 0.1  # at a stream's end, for the prefill worker's timings


# A remote prefill's lease covers this much more than its predicted wait and compute.
LEASE_HEADROOM = 1.5


def prefill_lease_s(timeouts: RemoteTimeouts, expected_s: float | None) -> float:
    """The decode worker's lease on the blocks a remote prefill's KV goes to, until its first
    part lands (each part renews it: `progress_cap_s`): `prefill_timeout_s`, or where the
    prefill worker's queue ahead of it and its own compute are predicted to take longer
    (`expected_s`), LEASE_HEADROOM x that, up to `max_prefill_timeout_s`. Past the lease the
    transfer fails and the prompt is prefilled again on the decode worker: a lease shorter
    than the queue would throw the prefill worker's work away."""
    base = timeouts.prefill_timeout_s
    if not expected_s or expected_s * LEASE_HEADROOM <= base:
        return base
    return min(expected_s * LEASE_HEADROOM, max(base, timeouts.max_prefill_timeout_s))


def progress_cap_s(timeouts: RemoteTimeouts, lease_s: float) -> float:
    """How long a remote prefill may take in all while its KV keeps landing: the decode
    worker renews the lease (`lease_s`) with each part that lands, so only a prefill that
    makes no progress for a lease is cut off (then prefilled again on the decode worker),
    not one that is merely slower than predicted; this caps that."""
    return max(lease_s, timeouts.max_prefill_timeout_s)


def prefill_wait_s(load: WorkerLoad, sent_tokens: float, rate: float) -> float:
    """Seconds until a prefill worker has computed what waits there, a request just placed
    on it included (`router.cost.pending_prefill_tokens`), at `rate`: its measured rate,
    else a peer's or the prior (`CostModel.prefill_rate`; the prior is slow, so a cold
    worker's queue gets a long lease, not the shortest)."""
    return pending_prefill_tokens(load, sent_tokens) / rate


async def remote_prefill(req: GenerateRequest, decode: DecodeClient, prefill: PrefillClient,
                         clock: StageClock, *, timeouts: RemoteTimeouts, liveness: Liveness,
                         abort_on: Callable[[DecodeClient, str], None], timed: bool = True,
                         budget_s: float | None = None, expected_s: float | None = None
                         ) -> AsyncGenerator[TokenEvent, None]:
    """The request's events through a remote prefill. RemotePrefillFailed before the first
    token means: prefill locally. `budget_s` caps the prefill and KV waits (the request's
    first-token deadline); `expected_s`: the prefill worker's predicted wait and compute
    for it (`prefill_lease_s`); `timed`: this attempt's stages go into `clock`."""
    cfg = timeouts
    lease_s = prefill_lease_s(cfg, expected_s)
    cap_s = progress_cap_s(cfg, lease_s)
    lease_s = min(lease_s, budget_s or lease_s)
    # The prefill call may run until the cap: the decode worker's lease, renewed by each
    # part that lands, is what ends one that stalls (its stream then fails: KV timeout).
    prefill_timeout_s = min(cap_s, budget_s or cap_s)
    kv_wait_s = min(cap_s + cfg.transfer_timeout_s, budget_s or cap_s + cfg.transfer_timeout_s)
    decode_lost = liveness.lost_future(decode.worker_id)
    prefill_lost = liveness.lost_future(prefill.worker_id)
    # One stream on the decode worker: its first message is the allocation, then it decodes
    # from the moment the KV lands, the first token taken from the transfer's completion
    # notice (no extra hop through us).
    remote = decode.generate_remote(req, lease_s=lease_s,
                                    allocate_timeout_s=cfg.allocate_timeout_s,
                                    transfer_timeout_s=kv_wait_s,
                                    token_timeout_s=cfg.token_timeout_s)
    try:
        slot = await remote.allocation()
    except CapacityError as exc:
        remote.close()
        raise RemotePrefillFailed(f"decode allocation failed: {exc}",
                                  code=ErrorCode.ALLOCATE_FAILED) from exc
    except BaseException:
        remote.close()  # the worker frees whatever it had reserved
        raise
    if timed:
        clock.allocated()
    stream = remote.events()
    first_task: asyncio.Task[TokenEvent] = asyncio.create_task(anext(stream))  # type: ignore[arg-type]
    prefill_task = asyncio.create_task(prefill.prefill(req, slot, timeout_s=prefill_timeout_s))
    try:
        racing: set[asyncio.Future[Any]] = {prefill_task, first_task, prefill_lost}
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        if not first_task.done() and prefill_lost.done():
            raise RemotePrefillFailed(f"prefill worker {prefill.worker_id} is lost",
                                      code=ErrorCode.PREFILL_WORKER_LOST)
        if not first_task.done() and prefill_task.exception() is not None:
            raise RemotePrefillFailed(f"prefill worker {prefill.worker_id} failed: "
                                      f"{describe(prefill_task.exception())}",
                                      code=ErrorCode.PREFILL_FAILED)
        try:
            first = await first_task
        except (PdserveError, TimeoutError) as exc:
            if decode_lost.done():
                raise  # the decode worker itself is gone: another one takes the request
            raise RemotePrefillFailed(f"KV never arrived: {describe(exc)}",
                                      code=ErrorCode.TRANSFER_FAILED) from exc
        if timed:
            clock.first_token()
        yield first
        if first.finished:
            if timed:
                await _prefill_report(prefill_task, clock, cfg.prefill_report_wait_s)
            return
        async for ev in stream:
            if ev.finished and timed:
                await _prefill_report(prefill_task, clock, cfg.prefill_report_wait_s)
            yield ev
    except BaseException:
        first_task.cancel()
        prefill_task.cancel()
        # Make sure the decode worker fences the transfer and frees the blocks before a
        # fallback reuses the request id there; a lost one is not waited for.
        if decode_lost.done():
            abort_on(decode, req.request_id)
        else:
            with contextlib.suppress(PdserveError, TimeoutError, asyncio.CancelledError):
                await asyncio.shield(decode.abort(req.request_id))
        raise
    finally:
        if not first_task.done():
            first_task.cancel()
            with contextlib.suppress(BaseException):
                await first_task  # the stream must not be running when we close it
        await stream.aclose()  # type: ignore[attr-defined]
        remote.close()


async def _prefill_report(task: asyncio.Task[PrefillReport], clock: StageClock,
                          wait_s: float) -> None:
    """Put the prefill worker's stage timings into `clock`. Its reply comes as its KV is
    sent, so it is in before the last token but for a hop or a busy worker: wait a little
    for it (the last token waits with it), never fail."""
    if not task.done():
        await asyncio.wait({task}, timeout=wait_s)
    if task.done() and not task.cancelled() and task.exception() is None:
        clock.prefilled(task.result())


def describe(exc: BaseException | None) -> str:
    if isinstance(exc, PdserveError):
        return f"{exc.code}: {exc.message}"
    return repr(exc)
