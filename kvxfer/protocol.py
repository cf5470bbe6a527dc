"""Wire protocol between KVSender and KVReceiver over one UCX endpoint.

Every message is a UCX tag message; tags are hashed by ucxx with the endpoint's own tag, so
they never collide across endpoints sharing a worker.

Control frames are JSON objects (never pickle), sent as two tag messages on the same tag: an
8-byte little-endian length, then the UTF-8 JSON. UCX keeps messages on one endpoint and tag in
order, so the pair stays together as long as only one coroutine writes a tag at a time.

- ``CTRL_TAG``            sender -> receiver requests: ``ping`` and ``write``. Several
                          transfers share it, so the sender serializes frames with a lock.
- ``reply_tag(seq)``      receiver -> sender replies for request `seq` (unique per endpoint):
                          ``pong``, ``accept``/``reject``, then ``done``/``failed``.
- ``data_tag(seq, i)``    the raw bytes of the i-th block run of transfer `seq`.

A write goes: sender ``write`` (descriptor id, transfer id, layout, destination runs, a
BLAKE3 ``digests`` entry per run, and an optional JSON ``notice`` handed to the decode side on
success; signed with `kvxfer.auth` when the cluster has a secret) -> receiver validates, posts
one recv per destination run straight into its pool, replies ``accept`` (or ``reject`` with a
code and message, before any data moved) -> sender sends each source run -> receiver replies
``done`` once every byte landed and matched its digest (else ``failed``). Each transfer has
its own tags, so transfers over one endpoint run concurrently. A ``ping`` may be signed too:
that authenticates the endpoint, which the receiver then lets idle (see kvxfer.receiver).
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import ucxx.exceptions

from pdserve.errors import ErrorCode, KVTransferError

CTRL_TAG = 0
MAX_FRAME_BYTES = 16 << 20
_SEQ_MOD = 1 << 28  # keeps tags below 2**61, where Python's int hash is the identity
SEQ_LIMIT = _SEQ_MOD  # a request's seq is in [1, SEQ_LIMIT)
_LEN = struct.Struct("<Q")

UCXError = ucxx.exceptions.UCXError


def error(code: ErrorCode, message: str) -> KVTransferError:
    return KVTransferError(message, code=code)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the endpoint should be dropped."""


def next_seq(seq: int) -> int:
    return seq % (_SEQ_MOD - 1) + 1  # 1 .. 2**28 - 1; 0 would collide with CTRL_TAG


def reply_tag(seq: int) -> int:
    return seq << 32


def data_tag(seq: int, index: int) -> int:
    return (seq << 32) | (index + 1)


def encode(message: dict[str, Any]) -> tuple[bytes, bytes]:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return _LEN.pack(len(payload)), payload


def check_open(ep: Any) -> None:
    """Raise UCXError for an endpoint we aborted: ucxx would raise AttributeError."""
    if ep.closed:
        raise UCXError("the endpoint is closed")


async def send_frame(ep: Any, tag: int, message: dict[str, Any], timeout_s: float) -> None:
    header, payload = encode(message)
    check_open(ep)
    async with asyncio.timeout(timeout_s):
        await ep.send(header, tag=tag)
        check_open(ep)
        await ep.send(payload, tag=tag)


async def recv_frame(
    ep: Any, tag: int, timeout_s: float | None, *, max_bytes: int = MAX_FRAME_BYTES
) -> dict[str, Any]:
    """Receive one frame within `timeout_s`. A declared length above `max_bytes` is refused
    before anything is allocated for it."""
    header = new_header()
    check_open(ep)
    async with asyncio.timeout(timeout_s):
        await ep.recv(header, tag=tag)
        return await recv_payload(ep, tag, header, max_bytes)


def new_header() -> bytearray:
    """A buffer for a frame's length message (`recv_payload` reads the rest)."""
    return bytearray(_LEN.size)


async def recv_payload(ep: Any, tag: int, header: bytearray, max_bytes: int) -> dict[str, Any]:
    """The JSON object announced by `header` (already received); raises ProtocolError."""
    (length,) = _LEN.unpack(header)
    limit = min(max_bytes, MAX_FRAME_BYTES)
    if not 0 < length <= limit:
        raise ProtocolError(f"frame length {length} is outside (0, {limit}]")
    payload = bytearray(length)
    check_open(ep)
    await ep.recv(payload, tag=tag)
    try:
        # Strict UTF-8 (json.loads would guess UTF-16/32 from the first bytes); nesting too
        # deep for the decoder is a bad frame, not a crash of the connection's handler.
        message = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame is not JSON: {str(exc)[:200]}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("frame must be a JSON object with a string 'op'")
    return message
