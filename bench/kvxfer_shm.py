"""Same-host KV transfer (issue 19 item 2): each path against memcpy, in one run.

    python bench/kvxfer_shm.py [--mb 64] [--iters 10] [--json docs/bench/kvxfer_shm_X.json]

A receiver process owns a destination pool behind a signed `KVReceiver` (staging rings on),
a raw ucxx listener, and a ucxx worker; this process moves `--mb` MiB to it every way below,
round-robin one transfer of each per iteration (so a busy machine's drift hits all alike),
and prints the median GB/s and its ratio to the memcpy measured in the same rounds:

- memcpy (torch, 1 process): the same bytes copied once in this process, the ceiling;
- raw ucxx, error handling on: one tag send to the listener's endpoint + a 1-byte ack, what
  kvxfer's endpoints get on one host (UCX offers only TCP loopback with peer-failure checks);
- raw ucxx, error handling off (option a's ceiling): the same over endpoints made from the
  worker addresses without error handling, so UCX may use shared memory / CMA;
- kvxfer UCX (today): `KVSender(shm=False)`, signed, with digests (the cross-host path);
- kvxfer ring contiguous / scattered (option b): through the staging ring (a receiver with
  ``shm_cma=False``), signed frames, no digests (kvxfer.shm says why); scattered: one run
  per block;
- kvxfer cma contiguous / scattered (the default where the kernel allows it): the receiver
  reads the sender's blocks itself with process_vm_readv, one copy (kvxfer.cma).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# As the workers run (pdserve.cli): UCX requests completed by a notifier thread, not by
# spinning the event loop, which would take a core from the copy threads.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
from bench_kvxfer import layout_for, machine, quiet_logs

from kvxfer import KVReceiver, KVSender
from kvxfer.auth import KVAuth
from pdserve.control import KVDescriptor

DESC_ID = "bench-decode:1"
RING_ID = "bench-ring:1"
KEY = b"bench-kv-key-0123456789abcdef012"
DATA_TAG, ACK_TAG = 1, 2


async def _anyone(_: str) -> bool:
    return True


def receiver_main(conn: Connection, nbytes: int, slot_mb: int, slots: int) -> None:
    quiet_logs()
    torch.set_num_threads(1)
    asyncio.run(_receiver(conn, nbytes, slot_mb, slots))


async def _receiver(conn: Connection, nbytes: int, slot_mb: int, slots: int) -> None:
    import ucxx

    layout, _ = layout_for(nbytes)
    pool = torch.zeros(layout.shape, dtype=torch.float16)
    ring_pool = torch.zeros(layout.shape, dtype=torch.float16)
    raw_buf = np.zeros(nbytes, dtype=np.uint8)
    ack = np.ones(1, np.uint8)

    async def raw_handler(ep: Any) -> None:
        try:
            while True:
                await ep.recv(raw_buf, tag=DATA_TAG)
                await ep.send(ack, tag=ACK_TAG)
        except ucxx.exceptions.UCXError:
            return

    raw = ucxx.create_listener(raw_handler, port=0)
    auth = KVAuth(KEY, authorize_sender=_anyone)
    async with KVReceiver(pool, layout, DESC_ID, auth=auth) as rx, \
            KVReceiver(ring_pool, layout, RING_ID, auth=auth, shm_slot_bytes=slot_mb << 20,
                       shm_slots=slots, shm_cma=False) as ring_rx:
        conn.send((rx.address, ring_rx.address, raw.port, bytes(ucxx.get_worker_address())))
        peer = await asyncio.to_thread(conn.recv)  # the sender's worker address
        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(peer), endpoint_error_handling=False)

        async def no_eh() -> None:
            while True:
                await ep.recv(raw_buf, tag=DATA_TAG, force_tag=True)
                await ep.send(ack, tag=ACK_TAG, force_tag=True)

        served = asyncio.create_task(no_eh())
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd is None:
                break
            waits = [(ring_rx if t.startswith("ring") else rx).expect(t, ids, timeout_s=120)
                     for t, ids in cmd]
            conn.send("ready")
            await asyncio.gather(*waits)
            conn.send("done")
        served.cancel()
    raw.close()
    ucxx.stop_notifier_thread()


async def bench(nbytes: int, iters: int, slot_mb: int, slots: int) -> dict[str, list[float]]:
    import ucxx

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(child, nbytes, slot_mb, slots), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        address, ring_address, raw_port, rx_worker = parent.recv()
        parent.send(bytes(ucxx.get_worker_address()))
        layout, nblocks = layout_for(nbytes)
        src_pool = torch.randn(layout.shape, dtype=torch.float32).to(torch.float16)
        rng = np.random.default_rng(1)
        contiguous = (list(range(nblocks)), list(range(nblocks, 2 * nblocks)))
        scattered = (rng.permutation(layout.num_blocks)[:nblocks].tolist(),
                     rng.permutation(layout.num_blocks)[:nblocks].tolist())
        descs = {DESC_ID: KVDescriptor(DESC_ID, "bench-decode", 1, address, layout),
                 RING_ID: KVDescriptor(RING_ID, "bench-ring", 1, ring_address, layout)}

        async def resolve(desc_id: str) -> KVDescriptor:
            return descs[desc_id]

        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        buf = src.numpy()
        ack = np.empty(1, np.uint8)
        eh_on = await ucxx.create_endpoint("127.0.0.1", raw_port)
        eh_off = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(rx_worker), endpoint_error_handling=False)
        auth = KVAuth(KEY, sender_id="bench-prefill")
        times: dict[str, list[float]] = {}
        async with KVSender(layout, resolve, auth=auth, shm=False) as over_ucx, \
                KVSender(layout, resolve, auth=auth) as staged:
            await over_ucx.warmup(descriptor_id=DESC_ID)
            await staged.warmup(descriptor_id=DESC_ID)
            await staged.warmup(descriptor_id=RING_ID)
            peers = {p.address: p for p in staged._peers.values()}
            assert peers[address].cma, "no cross-memory attach"
            assert peers[ring_address].ring is not None, "no staging ring"

            async def raw(ep: Any, force: bool) -> None:
                await ep.send(buf, tag=DATA_TAG, force_tag=force)
                await ep.recv(ack, tag=ACK_TAG, force_tag=force)

            async def memcpy() -> None:
                dst.copy_(src)

            rows: dict[str, Any] = {
                "memcpy (torch, 1 process)": memcpy,
                "raw ucxx, error handling on (tcp)": lambda: raw(eh_on, False),
                "raw ucxx, error handling off (option a)": lambda: raw(eh_off, True),
            }
            transfers: list[tuple[str, list[int]]] = []
            for name, tx, desc_id, (src_ids, dst_ids) in (
                    ("kvxfer UCX (today: signed + digests)", over_ucx, DESC_ID, contiguous),
                    ("kvxfer ring contiguous (option b)", staged, RING_ID, contiguous),
                    ("kvxfer ring scattered (option b)", staged, RING_ID, scattered),
                    ("kvxfer cma contiguous (default)", staged, DESC_ID, contiguous),
                    ("kvxfer cma scattered (default)", staged, DESC_ID, scattered)):
                tag = "ring" if desc_id == RING_ID else name[7:10]
                ids = [f"{tag}-{name[-22:]}-{i}" for i in range(iters + 2)]
                transfers += [(t, dst_ids) for t in ids]
                rows[name] = (tx, desc_id, src_ids, dst_ids, iter(ids))

            parent.send(transfers)
            assert await asyncio.to_thread(parent.recv) == "ready"
            for i in range(iters + 2):  # round-robin; the first two rounds warm up
                for name, row in rows.items():
                    started = time.perf_counter()
                    if callable(row):
                        await asyncio.wait_for(row(), 60)
                    else:
                        tx, desc_id, src_ids, dst_ids, ids = row
                        await tx.send(desc_id, src_pool, src_ids, dst_ids, next(ids), 60)
                    if i >= 2:
                        times.setdefault(name, []).append(time.perf_counter() - started)
            assert await asyncio.to_thread(parent.recv) == "done"
        eh_on.abort()
        parent.send(None)
        return times
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def report(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    memcpy = statistics.median(times["memcpy (torch, 1 process)"])
    print(f"\n{nbytes >> 20} MiB, median of {len(times['memcpy (torch, 1 process)'])} "
          f"round-robin rounds, host memory, 2 processes\n")
    print(f"{'method':<42} {'GB/s':>7} {'ms':>8} {'vs memcpy':>10}")
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"median_ms": med * 1e3, "gbps": nbytes / med / 1e9,
                     "vs_memcpy": memcpy / med}
        print(f"{name:<42} {nbytes / med / 1e9:>7.2f} {med * 1e3:>8.2f} {memcpy / med:>10.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--slot-mb", type=int, default=4, help="staging slot size, MiB")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    record: dict[str, Any] = {"bench": "bench/kvxfer_shm.py", "iters": args.iters,
                              "mb": args.mb, "slot_mb": args.slot_mb, "slots": args.slots,
                              "ucxpy_enable_python_future":
                                  os.environ["UCXPY_ENABLE_PYTHON_FUTURE"],
                              "machine": machine(), "rounds": []}
    async def rounds() -> None:
        import ucxx

        try:
            for _ in range(args.repeat):
                times = await bench(args.mb << 20, args.iters, args.slot_mb, args.slots)
                record["rounds"].append({"summary": report(times, args.mb << 20),
                                         "times_s": times})
        finally:
            ucxx.stop_notifier_thread()  # else interpreter exit waits for it

    asyncio.run(rounds())
    record["machine"]["loadavg_after"] = os.getloadavg()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
