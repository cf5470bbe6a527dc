"""Tenants: who a client API key is, and what it may do (issue 21, item 5).

Every key is one tenant. The REST gateway and the router's gRPC API identify the caller by
its bearer key (`Tenants.identify`) and then:

- **Namespace its request ids.** A client's request id (REST ``X-Request-Id``, gRPC
  ``request_id``) is only its own label: the id the router and the workers use is
  `Tenant.request_id(label)`, ``"<tag>:<label>"``, where the tag is the first 16 hex digits of
  SHA-256 of the key (never the key; 64 bits, not reversible for a random key). Two keys that
  pick the same label never collide, and `Abort` of a label finds only the caller's own
  request: another key's is "not found". Responses echo the client's label exactly.
- **Bound its concurrency** (`max_concurrent`): requests (one REST request or one gRPC
  Generate, whatever its ``n``) admitted and not finished. One more is refused with
  `QuotaExceededError` (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED, code
  ``quota_exceeded``) before anything is tokenized or started.
- **Cap its latency class** (`max_class`): a request asking for a more urgent class than its
  key may use is *downgraded* to the key's ceiling, not refused, so a client written for
  ``interactive`` keeps working; REST answers the class used in ``X-Latency-Class``.
- **Show worker addresses only to admins** (`admin`): ``GET /v1/pdserve/workers`` answers 403
  (``permission_denied``) to other keys.

Keys given the old way (``--api-key`` / ``PDSERVE_API_KEY``) are operator keys: admin, no
quota, any class, as before. Tenant keys come from a keys file (`load_keys_file`,
``--api-key-file``), one key per line with optional attributes::

    # comment
    sk-alice-...  max_concurrent=4 max_class=standard
    sk-ops-...    admin
    sk-bob-...

A bare line is a key with no quota, any class, no admin rights. The file must be private
(``chmod 600``) like the cluster secret's; errors name the line, never the key. Without any
key the API is open: one anonymous tenant (`OPEN`) whose ids are the client's own, unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from pdserve.errors import QuotaExceededError
from pdserve.private_file import read_private_text
from pdserve.types import MAX_REQUEST_ID_LEN, LatencyClass

TAG_HEX_DIGITS = 16
KEYS_FILE_ENV = "PDSERVE_API_KEY_FILE"


@dataclass(frozen=True)
class KeyPolicy:
    """What one key may do. `max_concurrent` None: no quota of its own."""

    max_concurrent: int | None = None
    max_class: LatencyClass = LatencyClass.INTERACTIVE
    admin: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")


OPERATOR = KeyPolicy(admin=True)  # a key given by --api-key / PDSERVE_API_KEY


def key_tag(key: str) -> str:
    """A short, stable, non-reversible name of `key` (safe to log and to put in ids)."""
    return hashlib.sha256(b"pdserve/tenant/" + key.encode()).hexdigest()[:TAG_HEX_DIGITS]


@dataclass(frozen=True)
class Tenant:
    """One caller. `tag` is "" for the open API (no keys): its ids are the client's own."""

    tag: str
    policy: KeyPolicy = OPERATOR

    def request_id(self, label: str) -> str:
        """The internal id of the client's `label` (a valid request id itself). A label too
        long to prefix is replaced by its SHA-256, so the result stays within
        MAX_REQUEST_ID_LEN."""
        if not self.tag:
            return label
        prefix = f"{self.tag}:"
        if len(prefix) + len(label) > MAX_REQUEST_ID_LEN:
            label = "#" + hashlib.sha256(label.encode()).hexdigest()
        return prefix + label

    def latency_class(self, asked: LatencyClass) -> LatencyClass:
        """`asked`, or the key's ceiling when `asked` is more urgent."""
        ceiling = self.policy.max_class
        return ceiling if asked.priority < ceiling.priority else asked


OPEN = Tenant("")


class Lease:
    """One admitted request of a tenant; `release` (idempotent) when it ends any way."""

    def __init__(self, counts: dict[str, int], tag: str) -> None:
        self._counts, self._tag, self._held = counts, tag, True

    def release(self) -> None:
        if self._held:
            self._held = False
            left = self._counts[self._tag] - 1
            if left:
                self._counts[self._tag] = left
            else:
                del self._counts[self._tag]

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


@dataclass
class Tenants:
    """The keys of one API (REST and gRPC share one, so a quota spans both) and each key's
    requests in flight. `keys` are operator keys unless `policies` names them; every key of
    `policies` is accepted too. No keys at all: the API is open (`identify` -> `OPEN`).
    Plain Python, no locks: used from one event loop."""

    keys: Collection[str] = ()
    policies: Mapping[str, KeyPolicy] = field(default_factory=dict)
    _by_key: list[tuple[bytes, Tenant]] = field(init=False, repr=False)
    _in_flight: dict[str, int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        merged = {k: OPERATOR for k in self.keys} | dict(self.policies)
        self.keys = frozenset(merged)
        self.policies = MappingProxyType(merged)
        self._by_key = [(k.encode(), Tenant(key_tag(k), p)) for k, p in merged.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def identify(self, key: str | None) -> Tenant | None:
        """The tenant of bearer `key`; None when keys are required and `key` is none of them."""
        if not self._by_key:
            return OPEN
        if not key:
            return None
        given = key.encode()
        found = None
        for k, tenant in self._by_key:  # every key compared: timing reveals no near match
            if hmac.compare_digest(given, k):
                found = tenant
        return found

    def admit(self, tenant: Tenant) -> Lease:
        """Count one more request of `tenant`, or QuotaExceededError at its quota."""
        limit = tenant.policy.max_concurrent
        now = self._in_flight.get(tenant.tag, 0)
        if limit is not None and now >= limit:
            raise QuotaExceededError(
                f"this API key already has {now} requests in flight, its limit; retry when "
                "one finishes", retry_after_s=1)
        self._in_flight[tenant.tag] = now + 1
        return Lease(self._in_flight, tenant.tag)

    def in_flight(self, tenant: Tenant) -> int:
        return self._in_flight.get(tenant.tag, 0)


# --------------------------------------------------------------------------- keys file

_ATTRS = ("max_concurrent", "max_class", "admin")


def parse_keys(text: str, where: str = "keys file") -> dict[str, KeyPolicy]:
    """Key -> policy from a keys file's text (module docstring). ValueError names the line
    and the attribute, never a key."""
    policies: dict[str, KeyPolicy] = {}
    first_line: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        fields = [] if raw.lstrip().startswith("#") else raw.split()  # keys may hold '#'
        if not fields:
            continue
        key, attrs = fields[0], fields[1:]
        if key in first_line:
            raise ValueError(f"{where}, line {n}: repeats the key of line {first_line[key]}")
        first_line[key] = n
        kw: dict[str, object] = {}
        for attr in attrs:
            name, eq, value = attr.partition("=")
            if name not in _ATTRS:
                raise ValueError(f"{where}, line {n}: unknown attribute {name[:40]!r} "
                                 f"(expected {', '.join(_ATTRS)})")
            try:
                if name == "admin":
                    if eq and value.lower() not in ("true", "yes", "1"):
                        raise ValueError("admin takes no value")
                    kw["admin"] = True
                elif name == "max_concurrent":
                    kw["max_concurrent"] = int(value)
                else:
                    kw["max_class"] = LatencyClass(value.strip().lower())
            except ValueError as exc:
                raise ValueError(f"{where}, line {n}: bad {name}: {exc}") from None
        try:
            policies[key] = KeyPolicy(**kw)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"{where}, line {n}: {exc}") from None
    return policies


def load_keys_file(path: str | os.PathLike[str]) -> dict[str, KeyPolicy]:
    """The policies of the keys file at `path`. ValueError for an unreadable or empty file,
    one its group or others may read or write (``chmod 600``), or a bad line."""
    p = Path(path)
    text = read_private_text(p, "the API keys file")
    policies = parse_keys(text, f"the API keys file {p}")
    if not policies:
        raise ValueError(f"the API keys file {p} holds no key")
    return policies
