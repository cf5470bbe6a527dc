"""The decode side's records of connections and transfers, the validation of a write
request, and the UCX data path of a transfer: its posted receives, digest checks and fence
(see kvxfer.receiver for the lifecycle; kvxfer.shm for the staging-ring path)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from kvxfer.pool import DIGEST_HEX_CHARS, INLINE_DIGEST_BYTES, PoolBytes, check_blocks, digest
from kvxfer.protocol import UCXError, error, reply_tag, send_frame
from kvxfer.runs import expand_runs
from kvxfer.shm import Ring
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout

log = structlog.get_logger(__name__)

_ABORT_PERIOD_NS = 1_000_000_000  # bound on ucxx's blocking endpoint close


class State(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    PARTIAL = "partial"  # some parts landed; no writer is active until the next part
    DONE = "done"
    FAILED = "failed"


Notice = dict[str, Any]


class Expectation:
    """Awaitable for one expected transfer: once every byte landed it returns the writer's
    notice (a small JSON object sent along with the blocks, or None), else it raises
    KVTransferError. Either way, no byte lands in the blocks after it finished. Awaiting it
    again gives the same outcome; cancelling the awaiting task does not cancel the transfer
    (use `KVReceiver.cancel`).
    """

    def __init__(
        self, transfer_id: str, dst_block_ids: tuple[int, ...], fut: asyncio.Future[Notice | None]
    ):
        self.transfer_id = transfer_id
        self.dst_block_ids = dst_block_ids
        self._future = fut

    def done(self) -> bool:
        return self._future.done()

    def __await__(self) -> Generator[Any, None, Notice | None]:
        return asyncio.shield(self._future).__await__()


@dataclass(eq=False)
class Connection:
    ep: Any  # ucxx Endpoint
    peer: str
    warn: Callable[..., Any]  # rate-limited: a peer that never reads replies could flood
    authenticated: bool = False
    checking: bool = False  # a validly signed frame's sender is being looked up
    active: int = 0  # transfers running over it: it is not idle while one is
    ring: Ring | None = None  # its staging ring (kvxfer.shm), once the writer attached it
    offer: Ring | None = None  # a ring offered, not attached yet
    cma_pid: int | None = None  # the writer's pid, where we may read its blocks (kvxfer.cma)

    def abort(self, reason: str, *, fencing: bool = False) -> None:
        if not self.ep.closed:
            (log.warning if fencing else log.debug)(
                "kv_endpoint_aborted", peer=self.peer, reason=reason
            )
        with contextlib.suppress(UCXError):
            self.ep.abort(period=_ABORT_PERIOD_NS)

    async def reply(self, seq: int, message: dict[str, Any], timeout_s: float) -> bool:
        """Best effort: False if the peer is gone or too slow to take a small frame."""
        if self.ep.closed:
            return False
        try:
            await send_frame(self.ep, reply_tag(seq), message, timeout_s)
            return True
        except (UCXError, TimeoutError) as exc:
            if self.ep.closed:  # we dropped it meanwhile (evicted, fenced, closing)
                log.debug("kv_reply_dropped", peer=self.peer, op=message["op"])
            else:
                self.warn(peer=self.peer, op=message["op"], error=repr(exc))
            return False


@dataclass(eq=False)
class Transfer:
    transfer_id: str
    dst_block_ids: tuple[int, ...]
    deadline: float  # loop.time(): the next part must have landed by then
    future: asyncio.Future[Notice | None]
    renew_s: float  # each part that lands moves `deadline` to this long after it ...
    last_deadline: float  # ... but never past this (loop.time())
    notice: Notice | None = None
    runs: list[tuple[int, int]] = field(default_factory=list)
    digests: list[str] | None = None  # one per run, from the signed request
    timer: asyncio.TimerHandle | None = None
    state: State = State.PENDING
    recvs: list[asyncio.Task[Any]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # cancel() while ACTIVE
    stop_reason: KVTransferError | None = None
    fenced: asyncio.Event = field(default_factory=asyncio.Event)
    fence_ok: bool = True
    shm: bool = False  # its bytes come the connection's same-host way (kvxfer.shm, .cma)
    src: Any = None  # with kvxfer.cma: the writer's [address, bytes] per run (checked there)
    part: bool = False  # the write now accepted is a part: more writes follow
    landed: set[int] = field(default_factory=set)  # blocks written by the parts that ended
    writer: str | None = None  # the sender of its first part; later ones must be the same


def check_request(msg: dict[str, Any], transfer: Transfer, layout: KVLayout, *,
                  digests_required: bool, shm_ok: bool) -> list[tuple[int, int]]:
    """The destination runs of a write request for `transfer` (whose notice, digests and
    path it records); raises KVTransferError. `shm_ok`: the connection has a staging ring.

    A write with ``"part": true`` fills some of the expected blocks and more writes follow
    (the prefill worker sends each computed chunk while the next one computes); the write
    without it is the last: it carries the notice, and with the parts before it (which it may
    overwrite) it must cover exactly the expected blocks. Only the last one completes the
    transfer."""
    try:
        theirs = KVLayout.from_wire(msg.get("layout"))
    except ValueError as exc:
        raise error(ErrorCode.KV_PROTOCOL_ERROR, f"bad layout: {exc}") from exc
    if not theirs.compatible_with(layout):
        raise error(
            ErrorCode.KV_LAYOUT_MISMATCH,
            f"sender layout {theirs} is not compatible with receiver layout {layout}",
        )
    raw_runs = msg.get("runs")
    if not isinstance(raw_runs, list) or not all(
        isinstance(r, list)
        and len(r) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        for r in raw_runs
    ):
        raise error(ErrorCode.KV_PROTOCOL_ERROR,
                    "runs must be a list of [start, count] integer pairs")
    part = msg.get("part", False)
    if not isinstance(part, bool):
        raise error(ErrorCode.KV_PROTOCOL_ERROR, "part must be a boolean")
    notice = msg.get("notice")
    if notice is not None and not isinstance(notice, dict):
        raise error(ErrorCode.KV_PROTOCOL_ERROR, "notice must be a JSON object")
    if part and notice is not None:
        raise error(ErrorCode.KV_PROTOCOL_ERROR,
                    "only the last write of a transfer carries a notice")
    writer = msg.get("sender_id")
    writer = writer if isinstance(writer, str) else None
    if transfer.state is State.PARTIAL and writer != transfer.writer:
        raise error(ErrorCode.KV_DUPLICATE_TRANSFER,
                    f"transfer {transfer.transfer_id!r} already has another writer")
    shm = msg.get("shm", False)
    if shm is not False and (shm is not True or not shm_ok):
        raise error(ErrorCode.KV_PROTOCOL_ERROR,
                    "a staging-ring write on a connection without a ring")
    digests = msg.get("digests")
    if digests is None and digests_required and not shm:
        raise error(ErrorCode.KV_PROTOCOL_ERROR, "a signed write must carry its runs' digests")
    if digests is not None and not (
        isinstance(digests, list)
        and len(digests) == len(raw_runs)
        and all(isinstance(d, str) and len(d) == DIGEST_HEX_CHARS for d in digests)
    ):
        raise error(ErrorCode.KV_PROTOCOL_ERROR,
                    f"digests must be one {DIGEST_HEX_CHARS}-character hex string per run")
    runs = [(start, count) for start, count in raw_runs]
    if any(count < 1 for _, count in runs):
        raise error(ErrorCode.KV_PROTOCOL_ERROR, "every run must hold at least one block")
    expected = transfer.dst_block_ids
    if sum(count for _, count in runs) > len(expected):
        # Checked before expanding the runs: a declared count is never materialized.
        raise error(
            ErrorCode.KV_BLOCK_MISMATCH,
            f"transfer {transfer.transfer_id!r} expects {len(expected)} "
            "blocks, the writer's runs hold more",
        )
    blocks = expand_runs(runs)
    try:
        check_blocks(blocks, layout.num_blocks, "destination")
    except ValueError as exc:
        raise error(ErrorCode.KV_BLOCK_OUT_OF_RANGE, str(exc)) from exc
    written = set(blocks)
    if len(written) != len(blocks) or not written <= set(expected) or (
            not part and written | transfer.landed != set(expected)):
        raise error(
            ErrorCode.KV_BLOCK_MISMATCH,
            f"transfer {transfer.transfer_id!r} expects blocks {sorted(expected)}"
            f"{f' ({len(transfer.landed)} landed)' if transfer.landed else ''}, the writer "
            f"sent {sorted(blocks)}{' as a part' if part else ''}",
        )
    transfer.notice = notice
    transfer.digests = digests
    transfer.shm = shm is True
    transfer.src = msg.get("src")
    transfer.part = part
    if transfer.state is State.PENDING:
        transfer.writer = writer
    return runs


async def wait_recvs(transfer: Transfer, pool: PoolBytes) -> KVTransferError | None:
    """Every run landed and (with digests) matched its digest: None; else why not. A run
    is hashed as soon as it landed, in a thread, while the others still arrive."""
    loop = asyncio.get_running_loop()
    stop = asyncio.create_task(transfer.stop.wait())
    run_of = {task: index for index, task in enumerate(transfer.recvs)}
    pending: set[asyncio.Future[Any]] = set(transfer.recvs)
    try:
        while pending:
            remaining = transfer.deadline - loop.time()
            if remaining <= 0:
                return error(
                    ErrorCode.KV_TIMEOUT,
                    f"transfer {transfer.transfer_id!r} did not complete in time",
                )
            done, pending = await asyncio.wait(
                pending | {stop}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if stop in done:
                assert transfer.stop_reason is not None
                return transfer.stop_reason
            pending.discard(stop)
            for task in done:
                if task not in run_of:  # a digest check
                    mismatch = cast(KVTransferError | None, task.result())
                    if mismatch is not None:
                        return mismatch
                elif (exc := task.exception()) is not None:
                    return error(
                        ErrorCode.KV_PEER_GONE,
                        f"transfer {transfer.transfer_id!r}: receive failed: {exc!r}",
                    )
                elif transfer.digests is not None:
                    check = asyncio.ensure_future(verify(transfer, pool, run_of[task]))
                    check.add_done_callback(lambda f: f.cancelled() or f.exception())
                    pending.add(check)
        return None
    finally:
        stop.cancel()


async def verify(transfer: Transfer, pool: PoolBytes, index: int) -> KVTransferError | None:
    assert transfer.digests is not None
    start, count = transfer.runs[index]
    buf = pool.run(start, count)
    if count * pool.layout.block_nbytes <= INLINE_DIGEST_BYTES:
        got = digest(buf)  # cheaper than the hop to a thread
    else:
        got = await asyncio.to_thread(digest, buf)
    if got == transfer.digests[index]:
        return None
    return error(
        ErrorCode.KV_INTEGRITY_FAILED,
        f"transfer {transfer.transfer_id!r}: blocks {start}..{start + count - 1} do not "
        "match the digest the writer signed (altered in flight)",
    )


async def fence(conn: Connection, transfer: Transfer, grace_s: float, timeout_s: float) -> None:
    """Return once every receive posted for `transfer` completed or was cancelled by UCX
    (aborting the endpoint after `grace_s`); sets `fence_ok` False if UCX never said so."""
    pending = {t for t in transfer.recvs if not t.done()}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    if pending:
        conn.abort(f"fencing transfer {transfer.transfer_id!r}", fencing=True)
        _, pending = await asyncio.wait(pending, timeout=timeout_s)
    for task in transfer.recvs:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: failures here are expected after an abort
    if pending:
        transfer.fence_ok = False
        log.error("kv_fence_failed", transfer_id=transfer.transfer_id, pending=len(pending))

