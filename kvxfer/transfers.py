"""The decode side's expected transfers and each one's state machine (the lifecycle drawn in
kvxfer.receiver): `expect` opens one, a write takes it (`take`, `accepted`), a part lands
(`part_landed`), its deadline passes, `cancel` ends it; `finish` records its one outcome,
which its `Expectation` reports, only once the fence holds."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any

import structlog

from kvxfer.inbound import Expectation, Notice, State, Transfer, check_request
from kvxfer.pool import check_blocks
from kvxfer.protocol import error
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout

log = structlog.get_logger(__name__)

_FINISHED_MEMORY = 4096  # finished transfer ids remembered, for clearer late-writer errors


class TransferTable:
    """The open transfers of one pool laid out as `layout`, by transfer id, and the outcome
    of the last `_FINISHED_MEMORY` finished ones. `cancel` waits for the fence at most
    `fence_grace_s` + `fence_timeout_s` (+1 s)."""

    def __init__(self, layout: KVLayout, *, fence_grace_s: float,
                 fence_timeout_s: float) -> None:
        self.layout = layout
        self._fence_grace_s = fence_grace_s
        self._fence_timeout_s = fence_timeout_s
        self.transfers: dict[str, Transfer] = {}
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()

    def expect(
        self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float, *,
        max_s: float | None = None
    ) -> Expectation:
        """See `KVReceiver.expect`."""
        blocks = tuple(dst_block_ids)
        try:
            if not transfer_id:
                raise ValueError("transfer_id must not be empty")
            if not blocks:
                raise ValueError("dst_block_ids must not be empty")
            check_blocks(blocks, self.layout.num_blocks, "destination")
            if len(set(blocks)) != len(blocks):
                raise ValueError("dst_block_ids contains duplicates")
            if transfer_id in self.transfers:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            if timeout_s <= 0:
                raise ValueError("timeout_s must be > 0")
            if max_s is not None and max_s < timeout_s:
                raise ValueError("max_s must be >= timeout_s")
        except ValueError as exc:
            raise error(ErrorCode.KV_INVALID_ARGUMENT, str(exc)) from exc
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Notice | None] = loop.create_future()
        # The decode service may cancel and never await: don't warn about unretrieved errors.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        now = loop.time()
        transfer = Transfer(transfer_id, blocks, now + timeout_s, fut, timeout_s,
                            now + (timeout_s if max_s is None else max_s))
        transfer.timer = loop.call_later(timeout_s, self._expired, transfer)
        self.transfers[transfer_id] = transfer
        return Expectation(transfer_id, blocks, fut)

    async def cancel(self, transfer_id: str, *, reason: str) -> None:
        """See `KVReceiver.cancel`."""
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            return
        err = error(ErrorCode.KV_CANCELLED, f"transfer {transfer_id!r} {reason}")
        if transfer.state in (State.PENDING, State.PARTIAL):  # no byte is on its way
            self.finish(transfer, err)
        elif transfer.state is State.ACTIVE and transfer.stop_reason is None:
            transfer.stop_reason = err
            transfer.stop.set()
        limit = self._fence_grace_s + self._fence_timeout_s + 1.0
        try:
            async with asyncio.timeout(limit):
                await transfer.fenced.wait()
        except TimeoutError:
            transfer.fence_ok = False
        if not transfer.fence_ok:
            raise error(
                ErrorCode.KV_FENCE_FAILED,
                f"transfer {transfer_id!r}: UCX did not confirm that its receives ended; "
                "its blocks must not be reused",
            )

    def take(self, msg: dict[str, Any], *, digests_required: bool, shm_ok: bool
             ) -> tuple[Transfer, list[tuple[int, int]]]:
        """The transfer a write request names, waiting for a writer, and the request's
        destination runs (`kvxfer.inbound.check_request`); raises KVTransferError.

        A request naming an expected transfer but the wrong blocks or layout also fails that
        transfer: the writer for it is broken and will not send the right data.
        """
        transfer_id = msg.get("transfer_id")
        if not isinstance(transfer_id, str):
            raise error(ErrorCode.KV_PROTOCOL_ERROR, "write request has no transfer_id")
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            state = self._finished.get(transfer_id)
            detail = f"already {state}" if state else "not expected (never or no longer)"
            raise error(ErrorCode.KV_UNKNOWN_TRANSFER, f"transfer {transfer_id!r} is {detail}")
        if transfer.state not in (State.PENDING, State.PARTIAL):
            raise error(ErrorCode.KV_DUPLICATE_TRANSFER,
                        f"transfer {transfer_id!r} already has a writer")
        try:
            runs = check_request(msg, transfer, self.layout,
                                 digests_required=digests_required, shm_ok=shm_ok)
        except KVTransferError as err:
            if err.code != ErrorCode.KV_DUPLICATE_TRANSFER:  # not another writer's to end
                self.finish(transfer, err)
            raise
        return transfer, runs

    def accepted(self, transfer: Transfer, runs: list[tuple[int, int]]) -> None:
        """The write `take` returned is accepted: from here on the writer may move bytes into
        the blocks, until the transfer's bytes landed or it failed."""
        transfer.state = State.ACTIVE
        transfer.runs = runs
        transfer.recvs = []  # a part before this one received all of its own
        if transfer.timer is not None:
            transfer.timer.cancel()

    def part_landed(self, transfer: Transfer) -> None:
        """A part's bytes landed (fenced, digests matched): wait for the next part. The
        writer is making progress, so its lease renews: the next part may take as long as
        the first could (`renew_s`), but not past the transfer's `last_deadline`."""
        transfer.landed.update(block for start, count in transfer.runs
                               for block in range(start, start + count))
        transfer.state = State.PARTIAL
        loop = asyncio.get_running_loop()
        transfer.deadline = min(transfer.last_deadline,
                                max(transfer.deadline, loop.time() + transfer.renew_s))
        transfer.timer = loop.call_at(transfer.deadline, self._expired, transfer)

    def _expired(self, transfer: Transfer) -> None:
        if transfer.state in (State.PENDING, State.PARTIAL):
            what = "no writer arrived" if transfer.state is State.PENDING \
                else f"{len(transfer.landed)} blocks landed, the last part did not arrive"
            msg = f"transfer {transfer.transfer_id!r}: {what} in time"
            self.finish(transfer, error(ErrorCode.KV_TIMEOUT, msg))

    def finish(self, transfer: Transfer, err: KVTransferError | None) -> None:
        """Record the outcome. Callers guarantee the fence already holds."""
        if transfer.state in (State.DONE, State.FAILED):
            return
        transfer.state = State.DONE if err is None else State.FAILED
        if transfer.timer is not None:
            transfer.timer.cancel()
        self.transfers.pop(transfer.transfer_id, None)
        self._finished[transfer.transfer_id] = "done" if err is None else "failed"
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        if err is not None and not transfer.fence_ok:
            err.code = ErrorCode.KV_FENCE_FAILED.value
        if not transfer.future.done():
            if err is None:
                transfer.future.set_result(transfer.notice)
            else:
                transfer.future.set_exception(err)
        transfer.fenced.set()
        log.debug("kv_transfer_finished", transfer_id=transfer.transfer_id, error=err and err.code)
