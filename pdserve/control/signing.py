"""Signed control-plane records: what is in Redis is trusted only if a cluster member wrote it.

Redis is shared state, not a root of trust. With a cluster secret every record a worker
writes (its lease record, its KV descriptor, its KV event batches) carries an HMAC-SHA256 tag
under a key derived from the secret for this purpose (`ClusterSecret.derive`), bound to the
namespace and the kind of record, so a tag is never valid for another namespace or another
kind of record. Readers (routers, prefill workers, decode workers) drop anything unsigned or
mis-signed before it is used: a forged "decode worker" is never listed, so it is never sent a
prompt, a request or the cluster token; a rewritten descriptor is never dialled, so it
receives no KV byte. Worker records also carry the time they were signed; a record older than
`max_age_s` (a replay of an old incarnation's record) is refused too.

Without a secret nothing is signed or checked (the open single-host mode, warned at start-up).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

SIG_FIELD = "sig"
SIGNED_AT_FIELD = "signed_at"


CONTROL_PURPOSE = "control-records"  # the key's purpose under the cluster secret


class SecretLike(Protocol):
    """What a signer needs of the cluster secret (pdserve.rpc.auth.ClusterSecret)."""

    def derive(self, purpose: str) -> bytes: ...


def signer_for(secret: SecretLike | None, namespace: str, *, max_age_s: float = 60.0
               ) -> RecordSigner | None:
    """The namespace's signer under the cluster secret; None in the open mode (no secret)."""
    if secret is None:
        return None
    return RecordSigner(secret.derive(CONTROL_PURPOSE), namespace, max_age_s=max_age_s)


class SignatureError(ValueError):
    """A control-plane record is unsigned, mis-signed or too old."""


class RecordSigner:
    """Signs and verifies the JSON records and stream entries of one namespace.

    `max_age_s` bounds how old a signed worker record may be (they are re-signed by every
    heartbeat, so a fresh one is at most one heartbeat old; the slack covers clock skew
    between hosts). `clock` is `time.time` unless a test needs another.
    """

    def __init__(self, key: bytes, namespace: str, *, max_age_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        if len(key) < 16:
            raise ValueError("the signing key must be at least 16 bytes")
        if max_age_s <= 0:
            raise ValueError("max_age_s must be > 0")
        self._key = key
        self._namespace = namespace.encode()
        self.max_age_s = max_age_s
        self._clock = clock

    def __repr__(self) -> str:
        return f"RecordSigner(namespace={self._namespace.decode()!r})"  # never the key

    def _tag(self, kind: str, payload: bytes) -> str:
        mac = hmac.new(self._key, b"pdserve-record\0" + self._namespace + b"\0"
                       + kind.encode() + b"\0", hashlib.sha256)
        mac.update(payload)
        return mac.hexdigest()

    # ------------------------------------------------------------------ JSON records

    def sign_json(self, kind: str, fields: Mapping[str, Any], *, timestamp: bool = False) -> str:
        """`fields` as compact JSON with a ``sig`` (and, with `timestamp`, ``signed_at``)."""
        body = dict(fields)
        if timestamp:
            body[SIGNED_AT_FIELD] = self._clock()
        body[SIG_FIELD] = self._tag(kind, _canonical(body))
        return json.dumps(body, separators=(",", ":"))

    def verify_json(self, kind: str, raw: str | bytes, *, timestamp: bool = False
                    ) -> dict[str, Any]:
        """The record's fields (without ``sig``/``signed_at``); raises SignatureError."""
        if timestamp:
            return self.verify_timestamped(kind, raw)[0]
        return self._verified(kind, raw)[0]

    def verify_timestamped(self, kind: str, raw: str | bytes) -> tuple[dict[str, Any], float]:
        """A timestamped record's fields (without ``sig``/``signed_at``) and when it was
        signed; raises SignatureError, also if it is older than `max_age_s` (`check_age`)."""
        data, signed_at = self._verified(kind, raw)
        if isinstance(signed_at, bool) or not isinstance(signed_at, int | float):
            raise SignatureError("record has no signing time")
        self.check_age(signed_at)
        return data, float(signed_at)

    def check_age(self, signed_at: float) -> None:
        """SignatureError if a record signed at `signed_at` is older than `max_age_s` now
        (a replay): a reader that keeps a verified record re-checks this on each use."""
        age = self._clock() - signed_at
        if age > self.max_age_s:
            raise SignatureError(f"record signed {age:.0f}s ago, older than "
                                 f"{self.max_age_s:g}s (a replay?)")

    def _verified(self, kind: str, raw: str | bytes) -> tuple[dict[str, Any], object]:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SignatureError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SignatureError("not a JSON object")
        sig = data.pop(SIG_FIELD, None)
        if not isinstance(sig, str):
            raise SignatureError("unsigned record")
        if not hmac.compare_digest(sig, self._tag(kind, _canonical(data))):
            raise SignatureError("bad signature")
        return data, data.pop(SIGNED_AT_FIELD, None)

    # ------------------------------------------------------------------ stream entries

    def sign_fields(self, kind: str, owner: str, fields: Mapping[bytes, bytes]
                    ) -> dict[bytes, bytes]:
        """Stream entry `fields` with a ``sig`` field, bound to the stream's `owner`."""
        return {**fields, SIG_FIELD.encode(): self._fields_tag(kind, owner, fields).encode()}

    def verify_fields(self, kind: str, owner: str, fields: Mapping[bytes, bytes]
                      ) -> dict[bytes, bytes]:
        """The entry's fields without ``sig``; raises SignatureError."""
        rest = dict(fields)
        sig = rest.pop(SIG_FIELD.encode(), None)
        if not isinstance(sig, bytes):
            raise SignatureError("unsigned entry")
        if not hmac.compare_digest(sig, self._fields_tag(kind, owner, rest).encode()):
            raise SignatureError("bad signature")
        return rest

    def _fields_tag(self, kind: str, owner: str, fields: Mapping[bytes, bytes]) -> str:
        parts = [owner.encode()]
        for name in sorted(fields):
            value = fields[name]
            parts += [len(name).to_bytes(4, "big"), name, len(value).to_bytes(8, "big"), value]
        return self._tag(kind, b"".join(parts))


def _canonical(body: Mapping[str, Any]) -> bytes:
    # Sorted keys and Python's shortest float repr: a record re-encoded after json.loads
    # yields the same bytes, so writers and readers agree whatever order the fields came in.
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
