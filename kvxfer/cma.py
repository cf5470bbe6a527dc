"""Same-host single copy: the decode worker reads the prefill worker's blocks itself, with
``process_vm_readv`` (cross-memory attach), straight into its pool.

Preferred over the staging ring (kvxfer.shm) where the kernel allows it, because it copies
each byte once (the ring copies it twice, on two threads). It is set up in the same signed
``shm_open`` exchange: the prefill worker sends its pid, the address of a random 32-byte
token in its memory and the token; the decode worker reads that address of that pid and
uses this path only if it gets the token back (so a pid namespace, a seccomp filter, a
ptrace policy (Yama) or another host all leave the connection on the ring or UCX). A write on
this path names, inside its signed request, the source address and length of each run; the
receiver reads nothing else, and only for an ACTIVE transfer.

Fencing and dead peers: only the receiver's own copy thread writes its pool; it checks
between pieces of at most `PIECE_BYTES` whether the transfer stopped, so once a failed or
cancelled transfer is reported finished, nothing lands any more. A sender that died makes
the read fail (ESRCH), and its control endpoint reports the failure as on the UCX path.
Integrity is by the kernel's rule that only a process allowed to ptrace the prefill worker
(same uid) may read it; such a process could as well write either pool, so no digest would
add protection, and the per-run digests are skipped as on the ring (kvxfer.shm).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from kvxfer.protocol import error
from pdserve.errors import ErrorCode, KVTransferError

PIECE_BYTES = 8 << 20  # a stopped transfer stops within one piece
_TOKEN_BYTES = 32


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_readv = _libc()


def read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy `nbytes` at `remote` in process `pid` to `local` here; OSError if not all."""
    if _readv is None:
        raise OSError("process_vm_readv is not available")
    mine, theirs = _IOVec(local, nbytes), _IOVec(remote, nbytes)
    got = _readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
    if got != nbytes:
        errno = ctypes.get_errno()
        raise OSError(errno, f"process_vm_readv read {got} of {nbytes} bytes: "
                      f"{os.strerror(errno) if errno else 'short read'}")


class Probe:
    """The prefill side's token: what the decode side must read back to use this path."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self._buf = ctypes.create_string_buffer(self.token, _TOKEN_BYTES)

    def offer(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "probe": ctypes.addressof(self._buf),
                "token": self.token.hex()}


def reachable(msg: dict[str, Any]) -> int | None:
    """The writer's pid if its announced token reads back from its memory, else None."""
    pid, probe, token = msg.get("pid"), msg.get("probe"), msg.get("token")
    if not (isinstance(pid, int) and isinstance(probe, int) and isinstance(token, str)) \
            or isinstance(pid, bool) or pid <= 0 or probe <= 0:
        return None
    got = ctypes.create_string_buffer(_TOKEN_BYTES)
    try:
        read(pid, ctypes.addressof(got), probe, _TOKEN_BYTES)
    except OSError:
        return None
    return pid if got.raw.hex() == token else None


def pieces(dst: Sequence[tuple[int, int]], src: Any, limit: int) -> list[tuple[int, int, int]]:
    """(local offset, remote address, bytes) pieces of at most `limit`; ValueError unless
    `src` is one [address, bytes] pair per destination run, of the same length."""
    if not isinstance(src, list) or len(src) != len(dst) or not all(
            isinstance(s, list) and len(s) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in s)
            for s in src):
        raise ValueError("src must be one [address, bytes] pair per run")
    out = []
    for (offset, nbytes), (address, length) in zip(dst, src, strict=True):
        if length != nbytes:
            raise ValueError(f"a source run of {length} bytes for {nbytes}")
        out += [(offset + at, address + at, min(limit, nbytes - at))
                for at in range(0, nbytes, limit)]
    return out


def lanes() -> int:
    """Copy threads for one transfer: two where this process may run on two CPUs (the
    writer waits meanwhile, so its CPU is free), else one."""
    try:
        return min(2, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return 1


async def receive(pid: int, base: int, work: list[tuple[int, int, int]], transfer_id: str,
                  executor: Executor, stop: asyncio.Event,
                  stop_reason: Callable[[], KVTransferError | None],
                  deadline: float, *, parallel: int = 1) -> KVTransferError | None:
    """Read every piece into the pool at `base`, in up to `parallel` threads of `executor`
    (pieces dealt round-robin). None once all landed, else why not; either way no thread
    writes the pool any more when it returns (the fence)."""
    loop = asyncio.get_running_loop()
    stopped = False

    def copy(mine: list[tuple[int, int, int]]) -> None:
        for offset, address, nbytes in mine:
            if stopped:
                return
            read(pid, base + offset, address, nbytes)

    n = max(1, min(parallel, len(work)))
    copying = [loop.run_in_executor(executor, copy, work[lane::n]) for lane in range(n)]
    halt: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        failed: BaseException | None = None
        pending: set[asyncio.Future[Any]] = set(copying)
        while pending and failed is None:
            left = deadline - loop.time()
            done = (await asyncio.wait({*pending, halt}, timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED))[0] \
                if left > 0 else set()
            if halt in done:
                return stop_reason() or error(ErrorCode.KV_CANCELLED,
                                              f"transfer {transfer_id!r} stopped")
            if not done:
                return error(ErrorCode.KV_TIMEOUT,
                             f"transfer {transfer_id!r} did not complete in time")
            pending -= done
            failed = next((f.exception() for f in done if f.exception() is not None), None)
        if failed is not None:
            return error(ErrorCode.KV_PEER_GONE, f"transfer {transfer_id!r}: reading the writer's "
                         f"blocks failed (it died?): {failed}")
        return None
    finally:
        stopped = True
        halt.cancel()
        await asyncio.wait(copying)
        for fut in copying:
            if not fut.cancelled():
                fut.exception()
