"""One end of a same-host KV transfer in its own process, for tests/test_kv_shm.py to kill
mid-transfer. Its copies are slowed (0.3 s per chunk after the first), and it prints
``PEER copying`` once a chunk is in flight, so the test kills it with bytes moving.

    python tests/kv_shm_peer.py receiver LAYOUT_JSON          # prints its address, then
                                                             # reads "XID ID,ID,..." lines
    python tests/kv_shm_peer.py sender LAYOUT_JSON ADDRESS XID DST_IDS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kvxfer import KVReceiver, KVSender, shm
from pdserve.control import KVDescriptor
from pdserve.types import KVLayout

DESC_ID = "shm-peer:1"
_calls = 0


def _slowed(copy: Any) -> Any:
    def slow(*args: Any) -> None:
        global _calls
        _calls += 1
        if _calls == 2:
            print("PEER copying", flush=True)
        if _calls >= 2:
            time.sleep(0.3)
        copy(*args)
    return slow


async def receiver(layout: KVLayout) -> None:
    shm.copy_in = _slowed(shm.copy_in)  # looked up by kvxfer.shm at each chunk
    pool = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    async with KVReceiver(pool, layout, DESC_ID, shm_slot_bytes=layout.block_nbytes,
                          shm_slots=2) as rx:
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
    role, layout = sys.argv[1], KVLayout.from_wire(json.loads(sys.argv[2]))
    if role == "receiver":
        asyncio.run(receiver(layout))
    else:
        asyncio.run(sender(layout, sys.argv[3], sys.argv[4],
                           [int(i) for i in sys.argv[5].split(",")]))


if __name__ == "__main__":
    main()
