"""One end of a same-host KV transfer in its own process, for tests/test_kv_shm.py to kill
mid-transfer. PATH is "cma" (the receiver reads the sender's blocks, kvxfer.cma) or "ring"
(kvxfer.shm). Its copies are slowed (0.3 s per piece after the first), and it prints
``PEER copying`` once a piece is in flight, so the test kills it with bytes moving.

From the repository root:

    python -m tests.helpers.kv_shm_peer receiver PATH LAYOUT_JSON
        # prints its address, then reads "XID ID,ID,..." lines
    python -m tests.helpers.kv_shm_peer sender PATH LAYOUT_JSON ADDRESS XID DST_IDS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch

from kvxfer import KVReceiver, KVSender, cma, shm
from pdserve.control import KVDescriptor
from pdserve.kv_layout import KVLayout

DESC_ID = "shm-peer:1"
_calls = 0


def _slowed(copy: Any) -> Any:
    def slow(*args: Any) -> None:
        global _calls
        _calls += 1
        n = _calls
        if n >= 2:
            time.sleep(0.3)
        if n == 2:
            # Said only after a first slowed piece: the copy starts while the accept goes
            # out, and a peer killed before its accept left is one that never answered (the
            # writer then retries on a new endpoint, as for a stale one, and cannot connect).
            print("PEER copying", flush=True)
        copy(*args)
    return slow


async def receiver(path: str, layout: KVLayout) -> None:
    shm.copy_in = _slowed(shm.copy_in)  # looked up by kvxfer.shm at each chunk
    cma.PIECE_BYTES = layout.block_nbytes
    cma.read = _slowed(cma.read)  # the first call is the setup probe
    pool = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    async with KVReceiver(pool, layout, DESC_ID, shm_slot_bytes=layout.block_nbytes,
                          shm_slots=2, shm_cma=path == "cma") as rx:
        print("PEER", rx.address, flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            xid, ids = line.split()
            await rx.expect(xid, [int(i) for i in ids.split(",")], timeout_s=60)


async def sender(layout: KVLayout, address: str, xid: str, dst_ids: list[int]) -> None:
    shm.copy_out = _slowed(shm.copy_out)

    async def resolve(_: str) -> KVDescriptor:
        return KVDescriptor(DESC_ID, "shm-peer", 1, address, layout)

    src = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
    async with KVSender(layout, resolve) as tx:
        await tx.send(DESC_ID, src, list(range(len(dst_ids))), dst_ids, xid, 60)


def main() -> None:
    role, path, layout = sys.argv[1], sys.argv[2], KVLayout.from_wire(json.loads(sys.argv[3]))
    if role == "receiver":
        asyncio.run(receiver(path, layout))
    else:
        asyncio.run(sender(layout, sys.argv[4], sys.argv[5],
                           [int(i) for i in sys.argv[6].split(",")]))


if __name__ == "__main__":
    main()
