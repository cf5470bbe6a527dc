"""A remote prefill's KV sent while the prompt computes: each chunk's finished blocks go to
the decode worker as a part of the transfer while the next chunk runs, and the last write
(the remaining blocks and the first token) completes it (kvxfer.receiver: parts).

The decode worker admits the request only on the last write, so a prefill that fails or is
cancelled midway never becomes visible there; its allocation is fenced and freed as for any
failed transfer. Should the engine preempt the prompt (its blocks freed and recomputed), the
parts' bytes may not be its KV: the last write then sends every block again, overwriting them.
"""

from __future__ import annotations

import asyncio

import torch

from kvxfer.sender import KVSender
from pdserve.kv_layout import KVDestination

MIN_PART_BLOCKS = 4  # a smaller part is not worth its round trip: it waits for the next chunk


class PartSender:
    """Sends one prompt's KV to `dest` in parts as the engine reports computed blocks
    (`progress`, an `AsyncEngine.prefill` callback), then the rest with `finish`.

    `skip` leading blocks are cached on the decode worker and never sent. Parts are sent one
    at a time; the prompt's last block always waits for the last write (which carries the
    notice, so that write is never empty).
    """

    def __init__(self, sender: KVSender, pool: torch.Tensor, dest: KVDestination, *,
                 skip: int, timeout_s: float, min_blocks: int = MIN_PART_BLOCKS) -> None:
        self._sender = sender
        self._pool = pool
        self._dest = dest
        self._skip = skip
        self._timeout_s = timeout_s
        self._min_blocks = max(1, min_blocks)
        self._sent = skip  # prompt blocks [0, _sent) are on the decode worker
        self._computed: tuple[int, ...] = ()  # the latest finished blocks we were told of
        self._stale = False  # a preemption: what the parts sent may not be the KV
        self._task: asyncio.Task[None] | None = None
        self._closed = False  # finish or abort began: no part starts any more
        self.parts = 0
        self.nbytes = 0

    def progress(self, preemptions: int, blocks: tuple[int, ...]) -> None:
        """Engine progress (on the event loop): start sending what is new, unless a part is
        on its way already (it goes on with the newest blocks when it is done)."""
        if preemptions:
            self._stale = True
        if self._closed or self._stale:
            return
        self._computed = blocks[:len(self._dest.block_ids) - 1]
        task = self._task
        if task is not None and (not task.done() or task.exception() is not None):
            return  # on its way (it takes the new blocks next), or failed (finish raises)
        if len(self._computed) - self._sent >= self._min_blocks:
            self._task = asyncio.create_task(self._send_parts())

    async def _send_parts(self) -> None:
        while not self._stale and len(self._computed) - self._sent >= self._min_blocks:
            upto = len(self._computed)
            res = await self._sender.send(
                self._dest.descriptor_id, self._pool, self._computed[self._sent:upto],
                self._dest.block_ids[self._sent:upto], self._dest.transfer_id,
                timeout_s=self._timeout_s, part=True)
            self._sent = upto
            self.parts += 1
            self.nbytes += res.nbytes

    async def finish(self, blocks: tuple[int, ...], preemptions: int,
                     notice: dict[str, object]) -> int:
        """After the prompt computed (`blocks`, all of them): wait for the part on its way
        (raising its failure), then send the rest with `notice`. Bytes sent in all."""
        self._closed = True
        if self._task is not None:
            await self._task
        start = self._skip if self._stale or preemptions else self._sent
        res = await self._sender.send(
            self._dest.descriptor_id, self._pool, blocks[start:], self._dest.block_ids[start:],
            self._dest.transfer_id, timeout_s=self._timeout_s, notice=notice)
        return self.nbytes + res.nbytes

    async def abort(self) -> None:
        """Stop sending parts; returns once no part reads our blocks any more (the sender
        fences a cancelled send). A no-op after `finish`."""
        self._closed = True
        task = self._task
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the prefill's own failure is what gets reported
