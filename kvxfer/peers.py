"""The prefill side's endpoints to KVReceivers, and one request/reply on them.

`Peers` keeps one endpoint per receiver address, shared by every transfer to it and reused;
one that died, or idled longer than `max_idle_s` (less than the receiver's idle limit, so
the receiver never closes it under us), is replaced by a new one, which on this host also
sets up a same-host path (kvxfer.rings). A request goes out with a fresh seq (signed with
`auth`) and its first reply is taken on its reply tag; a reused endpoint that died before
the receiver answered is replaced and the request sent once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
import ucxx

from kvxfer import cma
from kvxfer.auth import KVAuth
from kvxfer.protocol import (
    CTRL_TAG,
    ProtocolError,
    UCXError,
    error,
    next_seq,
    recv_frame,
    reply_tag,
    send_frame,
)
from kvxfer.rings import open_ring
from kvxfer.shm import SenderRing
from pdserve.control.descriptors import split_address
from pdserve.errors import ErrorCode, KVTransferError

log = structlog.get_logger(__name__)

_ABORT_PERIOD_NS = 1_000_000_000


class Peer:
    """One open endpoint to a KVReceiver, shared by every transfer to it."""

    def __init__(self, address: str, ep: Any) -> None:
        self.address = address
        self.ep = ep
        self.ctrl_lock = asyncio.Lock()  # a request frame is two tag messages: keep them paired
        self.answered = False  # the receiver replied on it at least once
        self.ring: SenderRing | None = None  # a same-host staging ring (kvxfer.shm)
        self.cma = False  # the receiver reads our blocks itself (kvxfer.cma)
        self.last_used = time.monotonic()
        self._seq = 0

    @property
    def alive(self) -> bool:
        return not self.ep.closed

    def next_seq(self) -> int:
        self._seq = next_seq(self._seq)
        return self._seq

    def abort(self) -> None:
        with contextlib.suppress(UCXError):
            self.ep.abort(period=_ABORT_PERIOD_NS)


class Unreachable(KVTransferError):
    """No endpoint to the receiver could be made (`Peers.request`)."""


class _Retry(Exception):
    """A reused endpoint turned out dead before the receiver answered our request (it may
    have closed it as idle just then): safe to send again on a new one, since a receiver
    that did take the request failed it when the endpoint died."""


Finish = Callable[[Peer, dict[str, Any]], Awaitable[None]]
"""Completes a request for the endpoint it goes on, before it is signed."""


class Peers:
    """The open endpoints by address (`by_address`); see the module docstring. `host_id`
    (`pdserve.control.workers.boot_id`, None without the same-host paths) is offered to each
    receiver."""

    def __init__(self, *, auth: KVAuth | None, host_id: str | None,
                 connect_timeout_s: float, max_idle_s: float) -> None:
        self._auth = auth
        self._host_id = host_id
        self._probe = cma.Probe()
        self._connect_timeout_s = connect_timeout_s
        self._max_idle_s = max_idle_s
        self.by_address: dict[str, Peer] = {}
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    def close(self) -> None:
        """Drop every endpoint; no new one is made."""
        self._closed = True
        for peer in list(self.by_address.values()):
            self.drop(peer)

    def drop(self, peer: Peer) -> None:
        if self.by_address.get(peer.address) is peer:
            del self.by_address[peer.address]
        peer.abort()

    def protocol_failure(self, peer: Peer, detail: str) -> KVTransferError:
        """Drops `peer`; the error to raise."""
        self.drop(peer)
        return error(ErrorCode.KV_PROTOCOL_ERROR,
                     f"receiver {peer.address} broke the protocol: {detail}")

    async def request(self, address: str, request: Mapping[str, Any],
                      remaining: Callable[[], float], finish: Finish | None = None,
                      ) -> tuple[Peer, int, dict[str, Any]]:
        """Send `request` with a fresh seq (signed when authenticated) and take its reply:
        (peer, seq, reply). A reused endpoint that died before any reply is replaced and the
        request sent once more (the receiver failed whatever it took on the dead one). A
        failure to connect raises `Unreachable` (a KVTransferError). `finish` completes the
        request for the endpoint it goes on, before it is signed."""
        for attempt in range(2):
            try:
                peer = await self._peer(address, remaining())
            except KVTransferError as exc:
                raise Unreachable(exc.message, code=exc.code) from exc
            frame = {**request, "seq": peer.next_seq()}
            if finish is not None:
                await finish(peer, frame)
            if self._auth is not None:
                frame = self._auth.sign(frame)
            try:
                return peer, frame["seq"], await self._exchange(
                    peer, frame, remaining(), retry_ok=attempt == 0)
            except _Retry:
                continue
        raise AssertionError("unreachable: the second attempt never retries")

    async def _exchange(
        self, peer: Peer, request: dict[str, Any], timeout_s: float, *, retry_ok: bool = False
    ) -> dict[str, Any]:
        """Send one request on the control tag and wait for its first reply."""
        seq = request["seq"]
        sent = False
        peer.last_used = time.monotonic()
        try:
            async with peer.ctrl_lock:
                await send_frame(peer.ep, CTRL_TAG, request, timeout_s)
            sent = True
            reply = await recv_frame(peer.ep, reply_tag(seq), timeout_s)
            peer.answered = True
            peer.last_used = time.monotonic()
            return reply
        except UCXError as exc:
            self.drop(peer)
            if retry_ok and (not sent or peer.answered):
                log.info("kv_endpoint_stale_reconnecting", peer=peer.address)
                raise _Retry from exc
            raise error(ErrorCode.KV_PEER_GONE,
                        f"lost connection to {peer.address}: {exc!r}") from exc
        except ProtocolError as exc:
            self.drop(peer)
            raise error(ErrorCode.KV_PEER_GONE,
                        f"lost connection to {peer.address}: {exc!r}") from exc
        except (TimeoutError, asyncio.CancelledError):
            # Given up mid-exchange: a frame cut off mid-send leaves the control stream out
            # of step, and a reply that comes late would wait on its tag with nobody to take
            # it. The endpoint is done; the receiver fails what it took on it.
            self.drop(peer)
            raise

    async def _peer(self, address: str, timeout_s: float) -> Peer:
        if self._closed:
            raise error(ErrorCode.KV_CLOSED, "sender is closed")
        peer = self.by_address.get(address)
        if peer is not None and peer.alive:
            if time.monotonic() - peer.last_used <= self._max_idle_s:
                return peer
            self.drop(peer)  # the receiver may be closing it as idle right now
        lock = self._connect_locks.setdefault(address, asyncio.Lock())
        async with asyncio.timeout(timeout_s):
            await lock.acquire()
        try:
            peer = self.by_address.get(address)
            if peer is not None and peer.alive:
                return peer
            try:
                host, port = split_address(address)
                # Bounded by ucxx's own connect timeout; cancelling it midway could leak the
                # half-made endpoint, so it is not wrapped in asyncio.timeout.
                ep = await ucxx.create_endpoint(
                    host, port, connect_timeout=max(0.1, min(timeout_s, self._connect_timeout_s))
                )
            except (UCXError, TimeoutError, ValueError, OSError) as exc:
                raise error(
                    ErrorCode.KV_CONNECT_FAILED, f"cannot connect to KV receiver {address}: {exc!r}"
                ) from exc
            peer = Peer(address, ep)
            if self._host_id is not None:
                try:
                    path = await open_ring(functools.partial(self._control, peer, timeout_s),
                                           self._host_id, self._probe)
                    peer.cma = path is True
                    peer.ring = path if isinstance(path, SenderRing) else None
                except BaseException:
                    peer.abort()
                    raise
            self.by_address[address] = peer
            log.info("kv_endpoint_opened", peer=address, staging_ring=peer.ring is not None,
                     cma=peer.cma)
            return peer
        finally:
            lock.release()

    async def _control(self, peer: Peer, timeout_s: float, request: dict[str, Any]
                       ) -> dict[str, Any]:
        """One control request on `peer` (signed when authenticated) and its reply."""
        frame = {**request, "seq": peer.next_seq()}
        if self._auth is not None:
            frame = self._auth.sign(frame)
        return await self._exchange(peer, frame, timeout_s)
