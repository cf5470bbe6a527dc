"""Prefill side of a KV transfer: write blocks of the local pool into a remote pool, over UCX
or, with a receiver on the same host, by its single copy (kvxfer.cma) or through a
shared-memory staging ring (kvxfer.shm).

This module runs one write: check it, resolve (and cache) the receiver's descriptor, pick the
path, move the bytes, take the receiver's answer. The endpoints it goes over, their reuse and
replacement, and the request/reply on them are `kvxfer.peers`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kvxfer.auth import KVAuth
from kvxfer.peers import Peer, Peers, Unreachable
from kvxfer.pool import DIGEST_RUN_BYTES, INLINE_DIGEST_BYTES, PoolBytes, check_blocks, digest
from kvxfer.protocol import ProtocolError, UCXError, data_tag, error, recv_frame, reply_tag
from kvxfer.runs import merge_pairs, split_runs
from kvxfer.shm import SenderRing, chunks, send_chunks
from pdserve.aio import AsyncResource
from pdserve.control.descriptors import KVDescriptor
from pdserve.control.workers import boot_id as host_id  # equal ends: the same host
from pdserve.errors import ErrorCode, KVTransferError
from pdserve.kv_layout import KVLayout

log = structlog.get_logger(__name__)

DescriptorResolver = Callable[[str], Awaitable[KVDescriptor | None]]
"""Looks a descriptor id up, e.g. `WorkerRegistry.get_descriptor`; None if it does not exist."""


@dataclass(frozen=True)
class SendResult:
    transfer_id: str
    nbytes: int
    num_runs: int
    elapsed_s: float


class KVSender(AsyncResource):
    """Writes KV blocks from local pools laid out as `layout` into remote KVReceivers.

    Keeps one endpoint per receiver address and reuses it; transfers to the same receiver
    run concurrently over it, and one unused for `max_idle_s` (less than the receiver's idle
    limit) is replaced by a new one. Descriptors come from `resolve_descriptor` and are cached
    until a receiver rejects one as stale. With `auth`, every write and ping is signed
    (`kvxfer.auth`); with `integrity` (the default) a write carries a digest of each run.
    With `shm` (the default) a receiver on the same host is written through a staging ring
    (kvxfer.shm: at memory speed, no digests) when it offers one and both pools are in host
    memory. Use as ``async with KVSender(...) as tx:``.
    """

    def __init__(
        self,
        layout: KVLayout,
        resolve_descriptor: DescriptorResolver,
        *,
        connect_timeout_s: float = 5.0,
        fence_timeout_s: float = 10.0,
        max_cached_descriptors: int = 4096,
        auth: KVAuth | None = None,
        integrity: bool = True,
        max_idle_s: float = 240.0,
        shm: bool = True,
    ) -> None:
        self.layout = layout
        self._endpoints = Peers(auth=auth, host_id=host_id() if shm else None,
                                connect_timeout_s=connect_timeout_s, max_idle_s=max_idle_s)
        self._copier: ThreadPoolExecutor | None = None
        self._auth = auth
        self._integrity = integrity or auth is not None  # a signing receiver requires it
        self._resolve = resolve_descriptor
        self._fence_timeout_s = fence_timeout_s
        self._max_cached = max_cached_descriptors
        self._descriptors: collections.OrderedDict[str, KVDescriptor] = collections.OrderedDict()

    @property
    def _peers(self) -> dict[str, Peer]:
        """The open endpoints by address (tests inspect them)."""
        return self._endpoints.by_address


    async def close(self) -> None:
        """Drop every endpoint; transfers still running fail with ``kv_peer_gone``."""
        self._endpoints.close()
        if self._copier is not None:
            self._copier.shutdown(wait=False)  # every transfer waited for its copies

    def forget_descriptor(self, descriptor_id: str) -> None:
        self._descriptors.pop(descriptor_id, None)

    # ------------------------------------------------------------------ public API

    async def warmup(
        self,
        *,
        descriptor_id: str | None = None,
        address: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        """Open (or check) the endpoint to a receiver now, so the first transfer does not pay
        for connection setup. With `descriptor_id`, also checks the receiver still owns it.
        """
        if (descriptor_id is None) == (address is None):
            raise ValueError("give exactly one of descriptor_id or address")
        async with self._deadline(timeout_s, "warmup") as remaining:
            if descriptor_id is not None:
                address = (await self._descriptor(descriptor_id, remaining())).ucx_address
            assert address is not None
            # Signed when authenticated: a signed ping authenticates the endpoint.
            peer, _, reply = await self._endpoints.request(address, {"op": "ping"}, remaining)
            if reply.get("op") != "pong":
                raise self._unexpected(peer, "pong", reply)
            if descriptor_id is not None and reply.get("descriptor_id") != descriptor_id:
                self.forget_descriptor(descriptor_id)
                raise error(
                    ErrorCode.KV_STALE_DESCRIPTOR,
                    f"receiver at {address} now serves descriptor "
                    f"{reply.get('descriptor_id')!r}, not {descriptor_id!r}",
                )

    async def send(
        self,
        descriptor_id: str,
        src_pool: torch.Tensor,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        transfer_id: str,
        timeout_s: float = 10.0,
        *,
        notice: Mapping[str, Any] | None = None,
        part: bool = False,
    ) -> SendResult:
        """Copy ``src_pool[src_block_ids[i]]`` into the remote block ``dst_block_ids[i]``.

        `notice` (a small JSON-serializable object, e.g. the first sampled token) travels with
        the request and is what the receiver's Expectation returns once the bytes landed.
        With `part`, these blocks are some of the transfer's (no notice): more sends with the
        same `transfer_id` follow, one at a time, and the one without `part` completes it
        (it may resend blocks a part sent; with the parts it must cover every expected block).
        Returns once the receiver confirmed every byte landed. Raises KVTransferError (see
        `pdserve.errors.ErrorCode.KV_*` for codes) on invalid arguments, an unknown or stale
        descriptor, a rejection by the receiver, a lost peer, or when `timeout_s` runs out.
        When it returns or raises, UCX no longer reads the source blocks, so they may be
        freed. For a CUDA pool the caller must make sure the kernels writing the source
        blocks have finished (e.g. synchronize their stream) before calling.
        """
        started = time.monotonic()
        src_ids, dst_ids = list(src_block_ids), list(dst_block_ids)
        try:
            src = PoolBytes(src_pool, self.layout)
            if not src_ids:
                raise ValueError("no blocks to send")
            runs = merge_pairs(src_ids, dst_ids)
            if self._integrity:
                runs = split_runs(runs, max(1, DIGEST_RUN_BYTES // self.layout.block_nbytes))
            check_blocks(src_ids, self.layout.num_blocks, "source")
            if len(set(dst_ids)) != len(dst_ids):
                raise ValueError("dst_block_ids contains duplicates")
            if part and notice is not None:
                raise ValueError("a part carries no notice: the last send does")
            if notice is not None:
                notice = dict(notice)
                json.dumps(notice)  # fail here, not halfway through the protocol
        except (ValueError, TypeError) as exc:
            raise error(ErrorCode.KV_INVALID_ARGUMENT, f"transfer {transfer_id!r}: {exc}") from exc

        async with self._deadline(timeout_s, f"transfer {transfer_id!r}") as remaining:
            desc = await self._descriptor(descriptor_id, remaining())
            if not desc.layout.compatible_with(self.layout):
                raise error(
                    ErrorCode.KV_LAYOUT_MISMATCH,
                    f"transfer {transfer_id!r}: local layout {self.layout} is not compatible "
                    f"with {descriptor_id!r} layout {desc.layout}",
                )
            try:
                check_blocks(dst_ids, desc.layout.num_blocks, "destination")
            except ValueError as exc:
                raise error(ErrorCode.KV_BLOCK_OUT_OF_RANGE,
                            f"transfer {transfer_id!r}: {exc}") from exc

            request: dict[str, Any] = {
                "op": "write",
                "transfer_id": transfer_id,
                "descriptor_id": descriptor_id,
                "layout": self.layout.to_wire(),
                "runs": [[dst, count] for _, dst, count in runs],
                "notice": notice,
            }
            if part:
                request["part"] = True
            digests: list[str] = []

            async def finish(peer: Peer, frame: dict[str, Any]) -> None:
                """The path, once the endpoint is known: its ring, or UCX with digests."""
                if peer.cma and not src.is_cuda:
                    base, block = src.tensor.data_ptr(), self.layout.block_nbytes
                    frame["shm"] = True
                    frame["src"] = [[base + start * block, count * block]
                                    for start, _, count in runs]
                elif peer.ring is not None and not src.is_cuda:
                    frame["shm"] = True
                elif self._integrity:
                    digests[:] = digests or await self._digests(src, runs)
                    frame["digests"] = digests

            try:
                peer, seq, reply = await self._endpoints.request(
                    desc.ucx_address, request, remaining, finish)
            except Unreachable:
                self.forget_descriptor(descriptor_id)  # the worker may have moved
                raise
            if reply.get("op") == "reject":
                code = str(reply.get("code", ErrorCode.KV_PROTOCOL_ERROR))
                if code == ErrorCode.KV_STALE_DESCRIPTOR:
                    self.forget_descriptor(descriptor_id)
                raise KVTransferError(
                    f"receiver {desc.ucx_address} rejected transfer {transfer_id!r}: "
                    f"{reply.get('message', '')}",
                    code=code,
                )
            if reply.get("op") != "accept":
                raise self._unexpected(peer, "accept", reply)

            try:
                if peer.cma and not src.is_cuda:  # the receiver reads the blocks itself
                    reply = await recv_frame(peer.ep, reply_tag(seq), remaining())
                elif peer.ring is not None and not src.is_cuda:
                    reply = await self._send_staged(peer, peer.ring, seq, src, runs,
                                                    transfer_id, remaining)
                else:
                    await self._send_data(peer, seq, src, runs, transfer_id, remaining())
                    reply = await recv_frame(peer.ep, reply_tag(seq), remaining())
            except (UCXError, ProtocolError) as exc:
                self._endpoints.drop(peer)
                raise error(
                    ErrorCode.KV_PEER_GONE,
                    f"transfer {transfer_id!r}: lost {peer.address} before its ack: {exc!r}",
                ) from exc
            if reply.get("op") == "failed":
                raise KVTransferError(
                    f"receiver {peer.address} failed transfer {transfer_id!r}: "
                    f"{reply.get('message', '')}",
                    code=str(reply.get("code", ErrorCode.KV_PEER_GONE)),
                )
            if reply.get("op") != "done":
                raise self._unexpected(peer, "done", reply)

        nbytes = len(src_ids) * self.layout.block_nbytes
        result = SendResult(transfer_id, nbytes, len(runs), time.monotonic() - started)
        log.debug("kv_transfer_sent", transfer_id=transfer_id, nbytes=nbytes, runs=len(runs))
        return result

    # ------------------------------------------------------------------ steps

    async def _digests(self, src: PoolBytes, runs: list[tuple[int, int, int]]) -> list[str]:
        """One digest per source run, hashed in a thread (the event loop keeps serving)
        unless they are small."""
        def hash_runs() -> list[str]:
            return [digest(src.run(start, count)) for start, _, count in runs]

        if sum(count for _, _, count in runs) * self.layout.block_nbytes <= INLINE_DIGEST_BYTES:
            return hash_runs()
        return await asyncio.to_thread(hash_runs)

    async def _send_data(
        self,
        peer: Peer,
        seq: int,
        src: PoolBytes,
        runs: list[tuple[int, int, int]],
        transfer_id: str,
        timeout_s: float,
    ) -> None:
        """Send every run over UCX; on any failure, fence: return only once UCX stopped
        reading. (Tests override it to alter the bytes in flight.)"""
        sends = [
            asyncio.create_task(peer.ep.send(src.run(start, count), tag=data_tag(seq, index)))
            for index, (start, _, count) in enumerate(runs)
        ]
        failure: BaseException | None = None
        try:
            done, pending = await asyncio.wait(
                sends, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION
            )
            failure = next((t.exception() for t in done if t.exception() is not None), None)
            if failure is None and not pending:
                return
        except BaseException as exc:  # cancelled: the source blocks still need the fence
            failure = exc
            raise
        finally:
            if failure is not None or any(not t.done() for t in sends):
                self._endpoints.drop(peer)
                _, still = await asyncio.wait(sends, timeout=self._fence_timeout_s)
                for task in sends:
                    if task.done() and not task.cancelled():
                        task.exception()
                if still:
                    log.error("kv_send_fence_failed", transfer_id=transfer_id, pending=len(still))
        if failure is not None:
            raise error(
                ErrorCode.KV_PEER_GONE,
                f"transfer {transfer_id!r}: sending to {peer.address} failed: {failure!r}",
            ) from failure
        raise TimeoutError

    async def _send_staged(self, peer: Peer, ring: SenderRing, seq: int, src: PoolBytes,
                           runs: list[tuple[int, int, int]], transfer_id: str,
                           remaining: Callable[[], float]) -> dict[str, Any]:
        """Stream the runs through the peer's staging ring; the receiver's last reply. Any
        failure here drops the peer (its ring's credits are then unknown)."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-shm-copy")
        block = self.layout.block_nbytes
        segments = chunks([(start * block, count * block) for start, _, count in runs],
                          ring.ring.slot_bytes)
        key = None if self._auth is None else self._auth.key
        try:
            reply = await send_chunks(peer.ep, seq, ring, src.flat(), segments, transfer_id,
                                      key, self._copier, remaining)
        except BaseException:
            self._endpoints.drop(peer)
            raise
        if reply.get("op") == "broken":
            raise self._endpoints.protocol_failure(peer, str(reply.get("message")))
        return reply

    async def _descriptor(self, descriptor_id: str, timeout_s: float) -> KVDescriptor:
        desc = self._descriptors.get(descriptor_id)
        if desc is not None:
            self._descriptors.move_to_end(descriptor_id)
            return desc
        try:
            async with asyncio.timeout(timeout_s):
                desc = await self._resolve(descriptor_id)
        except TimeoutError:
            raise
        except Exception as exc:
            raise error(
                ErrorCode.KV_DESCRIPTOR_LOOKUP_FAILED,
                f"looking up descriptor {descriptor_id!r} failed: {exc}",
            ) from exc
        if desc is None:
            raise error(
                ErrorCode.KV_DESCRIPTOR_NOT_FOUND,
                f"descriptor {descriptor_id!r} does not exist (the decode worker restarted or "
                "its lease expired)",
            )
        if desc.descriptor_id != descriptor_id:
            raise error(
                ErrorCode.KV_STALE_DESCRIPTOR,
                f"looked up {descriptor_id!r} but got {desc.descriptor_id!r}",
            )
        self._descriptors[descriptor_id] = desc
        while len(self._descriptors) > self._max_cached:
            self._descriptors.popitem(last=False)
        return desc

    def _unexpected(self, peer: Peer, expected: str, reply: dict[str, Any]) -> KVTransferError:
        """A reply that is not the `expected` op: drops `peer`; the error to raise."""
        return self._endpoints.protocol_failure(
            peer, f"expected {expected}, got {reply.get('op')!r}")

    @contextlib.asynccontextmanager
    async def _deadline(self, timeout_s: float, what: str) -> Any:
        """Yields `remaining()`; a TimeoutError inside becomes KVTransferError(kv_timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def remaining() -> float:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            return left

        try:
            yield remaining
        except TimeoutError as exc:
            raise error(ErrorCode.KV_TIMEOUT,
                        f"{what} did not complete within {timeout_s}s") from exc
