"""Authenticated KV writes: only a registered prefill worker of the same cluster may write.

The writer adds to every ``write`` request its worker id (``sender_id``), the time (``ts``,
Unix seconds), a random ``nonce`` and ``mac``: the hex HMAC-SHA256, under a key derived from
the cluster secret (`pdserve.rpc.auth.ClusterSecret.kv_key`), of the request's canonical JSON
(every field but ``mac``, keys sorted, no spaces): descriptor id (so the receiver's epoch),
transfer id, layout, destination runs, the first-token notice, seq, sender id, ts and nonce.

The receiver checks, before it posts any receive or even looks the transfer up: the MAC
(`hmac.compare_digest`), the time within `max_skew_s` of its own clock, then that
`authorize_sender` knows the sender id as a registered prefill worker. A refused write gets a
``reject`` with code ``kv_unauthenticated`` and changes nothing: the transfer it names stays
expected (a forger cannot cancel someone else's transfer), and the receiver keeps serving.
A replayed write names a transfer id that is already taken or finished, so it is refused as
such.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SenderCheck = Callable[[str], Awaitable[bool]]
"""Sender id -> whether it is a registered prefill worker of this cluster."""

MAC_FIELD = "mac"


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes a MAC covers: every field but ``mac``, as sorted, compact JSON."""
    body = {k: v for k, v in message.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def mac_of(key: bytes, message: Mapping[str, Any]) -> str:
    return hmac.new(key, canonical(message), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class KVAuth:
    """Both ends' view of KV write authentication. The writer needs `key` and `sender_id`;
    the receiver needs `key` and `authorize_sender` (None: any sender id that signs)."""

    key: bytes = field(repr=False)
    sender_id: str = ""
    authorize_sender: SenderCheck | None = None
    max_skew_s: float = 60.0

    def sign(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """`request` with sender id, time, nonce and MAC added."""
        if not self.sender_id:
            raise ValueError("a writer's KVAuth needs its sender_id")
        signed = {**request, "sender_id": self.sender_id, "ts": time.time(),
                  "nonce": secrets.token_hex(8)}
        signed[MAC_FIELD] = mac_of(self.key, signed)
        return signed

    async def check(self, message: Mapping[str, Any]) -> str | None:
        """None if `message` is an authentic write from an authorized sender, else why not."""
        given = message.get(MAC_FIELD)
        if not isinstance(given, str):
            return "the write is not signed"
        if not hmac.compare_digest(given.encode(), mac_of(self.key, message).encode()):
            return "the write's signature is wrong (another cluster's secret, or forged)"
        ts = message.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, int | float) \
                or not abs(time.time() - ts) <= self.max_skew_s:  # NaN fails too
            return f"the write's time is more than {self.max_skew_s:g}s from ours"
        sender = message.get("sender_id")
        if not isinstance(sender, str) or not sender:
            return "the write names no sender"
        if self.authorize_sender is not None and not await self.authorize_sender(sender):
            return f"sender {sender[:64]!r} is not a registered prefill worker of this cluster"
        return None
