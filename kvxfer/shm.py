"""Same-host fast path: KV moves through a shared-memory staging ring, not through UCX.

When a prefill worker and a decode worker share a host, UCX with peer-failure detection only
offers TCP loopback (~1 GB/s). Instead, per prefill peer, the decode worker creates a staging
file under /dev/shm (mode 0600, a random name, O_EXCL) of `slots` slots of `slot_bytes`, and
announces it only inside the authenticated control exchange on the existing UCX endpoint
(``shm_open`` -> ``shm_offer`` -> ``shm_attach``; with a cluster secret both requests are
signed and authenticate the connection like a signed ping). The prefill worker opens it by
that name, checks it is a regular file owned by its own uid with no group/other access, of
the announced size, holding the announced random token (so a same-named file in another
mount namespace or container is never taken for it), maps it, and says so; the decode worker
then unlinks the name, so nothing is left in /dev/shm once both are gone. Detection is
explicit, never assumed: same host means the same kernel boot id *and* the file opening as
described; otherwise, or with a CUDA pool on either side, the transfer goes over UCX as before.

A write on this path (``"shm": true`` in the signed request) streams the bytes of its runs,
in order, in chunks of `slot_bytes`: the sender holds a credit per free slot, copies chunk k
into a slot (in a thread), then sends a small binary "chunk k is in slot s" frame on the
transfer's data tag, HMAC-signed with the cluster's KV key when it has one. The receiver
checks the frame (next chunk in order, a slot not being copied, the exact length, the MAC),
copies the slot into the destination blocks of its pool in its own thread, and returns the
slot's credit on the transfer's reply tag. The two copies pipeline on two cores.

Fencing: the receiver's pool is only ever written by the receiver's own copy thread, and only
for a transfer that is ACTIVE; when a transfer fails (timeout, cancel, a dead peer, a bad
frame) no new copy starts, the running one ends, and only then is it reported finished. A
late or stray write by the sender can only touch staging slots, which are never read without
a valid frame of a live transfer. Dead peers are detected as on the UCX path: the control
endpoint keeps UCX's peer-failure detection (a killed process's connection is reset at once),
and every transfer has its deadline.

Integrity: by the kernel's file permissions. Only processes of the workers' own uid can
open the staging file, and such a process can as well write either worker's memory directly
(ptrace, /proc/PID/mem), so a digest of the staged bytes would protect against nobody who
could alter them, and no byte crosses a network. The per-run BLAKE3 digests are therefore
skipped on this path: they cost ~14 ms per 64 MiB per side, three times the copy itself.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import mmap
import os
import re
import secrets
import stat
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.protocol import (
    MAX_FRAME_BYTES,
    check_open,
    data_tag,
    error,
    new_header,
    recv_payload,
    reply_tag,
)
from pdserve.errors import ErrorCode, KVTransferError

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"pdserve-kv-[0-9a-f]{32}")
_HEADER_BYTES = 4096  # the token, then page-aligned slots
_TOKEN_BYTES = 32
DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 4 << 20
MAX_SLOT_BYTES = 256 << 20
_READY = struct.Struct("<QII")  # chunk index, slot, bytes
MAC_BYTES = 32
READY_BYTES = _READY.size + MAC_BYTES

Segment = tuple[int, int, int]  # (pool byte offset, slot byte offset, bytes)


class Ring:
    """A mapped staging file: `slots` slots of `slot_bytes` after a header holding `token`.

    The mapping lives as long as any view of it (`slot`), so a copy still running in a thread
    never loses its memory; `unlink` only removes the name.
    """

    def __init__(self, path: Path, mm: mmap.mmap, slots: int, slot_bytes: int,
                 token: bytes) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.token = token
        self._buf = np.frombuffer(mm, dtype=np.uint8)
        self.busy: set[int] = set()  # receiver: slots being copied out

    @staticmethod
    def nbytes(slots: int, slot_bytes: int) -> int:
        return _HEADER_BYTES + slots * slot_bytes

    @classmethod
    def create(cls, slots: int, slot_bytes: int, directory: Path = SHM_DIR) -> Ring:
        """A new staging file (decode side): 0600, exclusive, random name, pages resident."""
        if not 1 <= slots <= 64 or not 1 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"bad staging ring geometry {slots} x {slot_bytes}")
        path = directory / f"pdserve-kv-{secrets.token_hex(16)}"
        size = cls.nbytes(slots, slot_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        token = secrets.token_bytes(_TOKEN_BYTES)
        mm[:_TOKEN_BYTES] = token
        return cls(path, mm, slots, slot_bytes, token)

    @classmethod
    def attach(cls, name: str, token_hex: str, slots: int, slot_bytes: int,
               directory: Path = SHM_DIR) -> Ring:
        """Open the receiver's staging file (prefill side); OSError/ValueError if it is not
        exactly what was announced: a file of ours, private, of that size, with that token."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"bad staging file name {str(name)[:80]!r}")
        token = bytes.fromhex(token_hex)
        if len(token) != _TOKEN_BYTES:
            raise ValueError("bad staging token")
        if not 1 <= slots <= 64 or not 1 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"bad staging ring geometry {slots} x {slot_bytes}")
        path = directory / name
        size = cls.nbytes(slots, slot_bytes)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                    or st.st_mode & 0o077 or st.st_size != size:
                raise ValueError(f"{path} is not a private staging file of this user "
                                 f"(mode {st.st_mode:o}, uid {st.st_uid}, {st.st_size} bytes)")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        if not hmac.compare_digest(mm[:_TOKEN_BYTES], token):
            raise ValueError(f"{path} does not hold the announced token (another host's or "
                             "namespace's file)")
        return cls(path, mm, slots, slot_bytes, token)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def slot(self, index: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        start = _HEADER_BYTES + index * self.slot_bytes
        return self._buf[start:start + self.slot_bytes]


def chunks(runs: Sequence[tuple[int, int]], chunk_bytes: int) -> list[list[Segment]]:
    """The byte stream of `runs` ((pool byte offset, bytes), in order) cut into chunks of
    `chunk_bytes`: per chunk, its pieces (pool offset, offset in the slot, bytes)."""
    out: list[list[Segment]] = [[]]
    used = 0
    for offset, nbytes in runs:
        done = 0
        while done < nbytes:
            if used == chunk_bytes:
                out.append([])
                used = 0
            take = min(nbytes - done, chunk_bytes - used)
            out[-1].append((offset + done, used, take))
            used += take
            done += take
    return out


def copy_out(pool: np.ndarray[Any, Any], slot: np.ndarray[Any, Any],
             segments: list[Segment]) -> None:
    """Pool -> slot (sender); numpy releases the GIL for the copy."""
    for offset, at, nbytes in segments:
        np.copyto(slot[at:at + nbytes], pool[offset:offset + nbytes])


def copy_in(pool: np.ndarray[Any, Any], slot: np.ndarray[Any, Any],
            segments: list[Segment], stopped: Callable[[], bool]) -> None:
    """Slot -> pool (receiver), never once the transfer stopped."""
    for offset, at, nbytes in segments:
        if stopped():
            return
        np.copyto(pool[offset:offset + nbytes], slot[at:at + nbytes])


def _mac(key: bytes | None, transfer_id: str, head: bytes) -> bytes:
    if key is None:
        return bytes(MAC_BYTES)
    return hmac.new(key, b"kv-ready\x00" + transfer_id.encode() + b"\x00" + head,
                    hashlib.sha256).digest()


def ready_frame(key: bytes | None, transfer_id: str, chunk: int, slot: int,
                nbytes: int) -> bytes:
    head = _READY.pack(chunk, slot, nbytes)
    return head + _mac(key, transfer_id, head)


def parse_ready(key: bytes | None, transfer_id: str, frame: bytes) -> tuple[int, int, int]:
    head = frame[:_READY.size]
    if key is not None and not hmac.compare_digest(frame[_READY.size:],
                                                   _mac(key, transfer_id, head)):
        raise ValueError("the chunk frame's signature is wrong")
    chunk, slot, nbytes = _READY.unpack(head)
    return chunk, slot, nbytes


# --------------------------------------------------------------------------- sender


@dataclass(eq=False)
class SenderRing:
    """The prefill side of one peer's ring: which slots it holds a credit for."""

    ring: Ring
    free: collections.deque[int] = field(default_factory=collections.deque)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.free.extend(range(self.ring.slots))

    def give_back(self, slots: set[int]) -> None:
        self.free.extend(slots)
        slots.clear()
        self.changed.set()


async def send_chunks(ep: Any, seq: int, ring: SenderRing, pool: np.ndarray[Any, Any],
                      segments: list[list[Segment]], transfer_id: str, key: bytes | None,
                      executor: Executor, remaining: Callable[[], float]) -> dict[str, Any]:
    """Stream every chunk through `ring` and return the receiver's last reply (``done`` or
    ``failed``). Copies are queued on `executor` for every slot held, so its thread copies
    back to back; each chunk's frame goes out as its copy ends. Raises UCXError/
    ProtocolError/TimeoutError (the caller then drops the peer, ring and all); on return or
    raise, no copy reads `pool` any more."""
    loop = asyncio.get_running_loop()
    held: set[int] = set()
    reader = asyncio.ensure_future(_replies(ep, seq, ring, held, remaining))
    reader.add_done_callback(lambda f: f.cancelled() or f.exception())
    copies: collections.deque[tuple[asyncio.Future[None], int, int]] = collections.deque()
    sends: list[asyncio.Future[Any]] = []
    index = 0
    try:
        while index < len(segments) or copies:
            while index < len(segments) and ring.free:
                slot = ring.free.popleft()
                held.add(slot)
                copies.append((loop.run_in_executor(executor, copy_out, pool, ring.ring.slot(slot),
                                                    segments[index]), index, slot))
                index += 1
            wake = asyncio.ensure_future(ring.changed.wait())
            waits: set[asyncio.Future[Any]] = {reader, wake}
            if copies:
                waits.add(copies[0][0])
            try:
                await asyncio.wait(waits, timeout=remaining(), return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
            ring.changed.clear()
            if reader.done():
                return reader.result()  # failed early (or broke the protocol)
            while copies and copies[0][0].done():
                copy, chunk, slot = copies.popleft()
                copy.result()
                check_open(ep)
                nbytes = sum(n for _, _, n in segments[chunk])
                sends.append(asyncio.ensure_future(  # posted in order: UCX keeps it
                    ep.send(ready_frame(key, transfer_id, chunk, slot, nbytes),
                            tag=data_tag(seq, 0))))
                sends[-1].add_done_callback(lambda f: f.cancelled() or f.exception())
        async with asyncio.timeout(remaining()):
            return await asyncio.shield(reader)
    finally:
        for copy, _, _ in copies:
            copy.cancel()  # those not started yet; a running one is waited for below
        running = [copy for copy, _, _ in copies if not copy.cancelled()]
        if running:
            await asyncio.wait(running)  # the source blocks stay read until they end
        if reader.done() and not reader.cancelled() and reader.exception() is None:
            ring.give_back(held)  # done/failed: the receiver reads none of them any more
        else:
            reader.cancel()
        for send in sends:
            send.cancel()


CREDIT = 1 << 63  # a length header with this bit is a slot's credit, not a frame


async def _replies(ep: Any, seq: int, ring: SenderRing, held: set[int],
                   remaining: Callable[[], float]) -> dict[str, Any]:
    """Credits, then the final frame, in order on the transfer's reply tag."""
    while True:
        header = new_header()
        check_open(ep)
        async with asyncio.timeout(remaining()):
            await ep.recv(header, tag=reply_tag(seq))
        (value,) = struct.unpack("<Q", header)
        if not value & CREDIT:
            async with asyncio.timeout(remaining()):
                return await recv_payload(ep, reply_tag(seq), header, MAX_FRAME_BYTES)
        slot = value & ~CREDIT
        if slot not in held:
            return {"op": "broken", "message": f"credit for a slot not held: {slot}"}
        held.discard(slot)
        ring.free.append(slot)
        ring.changed.set()


# --------------------------------------------------------------------------- receiver


async def receive_chunks(ep: Any, seq: int, ring: Ring, pool: np.ndarray[Any, Any],
                         segments: list[list[Segment]], transfer_id: str, key: bytes | None,
                         executor: Executor, stop: asyncio.Event,
                         stop_reason: Callable[[], KVTransferError | None],
                         deadline: float) -> KVTransferError | None:
    """Copy each announced chunk from its slot into the pool (queued on `executor` as its
    frame arrives) and return its credit. None once every chunk landed, else why not; either
    way no copy into the pool runs any more when it returns (the fence), and every credit
    was sent, so the caller's final frame follows them on the reply tag."""
    loop = asyncio.get_running_loop()
    stopped = False
    copies: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
    credits: list[asyncio.Future[Any]] = []
    header = bytearray(READY_BYTES)
    incoming: asyncio.Future[Any] | None = None
    halt = asyncio.ensure_future(stop.wait())
    nxt = 0
    try:
        while nxt < len(segments) or copies:
            if incoming is None and nxt < len(segments):
                check_open(ep)
                incoming = asyncio.ensure_future(ep.recv(header, tag=data_tag(seq, 0)))
                incoming.add_done_callback(lambda f: f.cancelled() or f.exception())
            waits: set[asyncio.Future[Any]] = {halt}
            if incoming is not None:
                waits.add(incoming)
            if copies:
                waits.add(copies[0][0])
            left = deadline - loop.time()
            done = (await asyncio.wait(waits, timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED))[0] \
                if left > 0 else set()
            if halt in done:
                return stop_reason() or error(ErrorCode.KV_CANCELLED,
                                              f"transfer {transfer_id!r} stopped")
            if not done:
                return error(ErrorCode.KV_TIMEOUT,
                             f"transfer {transfer_id!r} did not complete in time")
            while copies and copies[0][0].done():
                fut, slot = copies.popleft()
                fut.result()
                ring.busy.discard(slot)
                check_open(ep)
                credits.append(asyncio.ensure_future(  # posted in order, before the final frame
                    ep.send(struct.pack("<Q", CREDIT | slot), tag=reply_tag(seq))))
                credits[-1].add_done_callback(lambda f: f.cancelled() or f.exception())
            if incoming is not None and incoming.done():
                if (exc := incoming.exception()) is not None:
                    return error(ErrorCode.KV_PEER_GONE,
                                 f"transfer {transfer_id!r}: writer lost: {exc!r}")
                incoming = None
                pieces = segments[nxt]
                try:
                    chunk, slot, nbytes = parse_ready(key, transfer_id, bytes(header))
                    if chunk != nxt or not 0 <= slot < ring.slots or slot in ring.busy \
                            or nbytes != sum(n for _, _, n in pieces):
                        raise ValueError(f"chunk {chunk} in slot {slot} ({nbytes} bytes) is "
                                         f"not chunk {nxt} in a free slot")
                except ValueError as exc:
                    return error(ErrorCode.KV_PROTOCOL_ERROR, f"transfer {transfer_id!r}: {exc}")
                ring.busy.add(slot)
                copies.append((loop.run_in_executor(executor, copy_in, pool, ring.slot(slot),
                                                    pieces, lambda: stopped), slot))
                nxt += 1
        if credits:
            _, late = await asyncio.wait(credits, timeout=max(0.0, deadline - loop.time()))
            if late or any(c.exception() is not None for c in credits):
                return error(ErrorCode.KV_PEER_GONE, f"writer of {transfer_id!r} took no credits")
        return None
    finally:
        stopped = True  # no copy starts or goes on into the pool from here
        halt.cancel()
        if incoming is not None and not incoming.done():
            incoming.cancel()  # our own frame buffer, not the pool
        for fut, _ in copies:
            fut.cancel()  # not started yet
        running = [fut for fut, _ in copies if not fut.cancelled()]
        if running:
            await asyncio.wait(running)
        for _, slot in copies:
            ring.busy.discard(slot)
