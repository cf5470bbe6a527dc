"""Log lines an outsider can trigger, at most one per interval per key.

Whoever can reach a port can make a server refuse things as fast as it can send them
(unauthenticated gRPC calls, forged control-plane records, unsigned KV writes); one log line
per refusal would let them fill the disk and bury everything else. `RateLimitedLog` keeps the
first line of each key, then stays quiet for `interval_s` and puts the count it swallowed on
the next line it writes (``suppressed=N``), so nothing goes uncounted.

Imports nothing from the project: `pdserve.rpc`, `pdserve.control` and `kvxfer` all use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

OVERFLOW_KEY = "<other>"  # the one key every key past `max_keys` shares


class RateLimitedLog:
    """One logger event, logged at most once per `interval_s` per key (with the count of
    lines it suppressed since the last one of that key); `total` counts every call.

    Keys should come from a small set the code chooses (a refusal reason, a record kind),
    not from what the peer sent; still, at most `max_keys` are tracked, and the rest share
    `OVERFLOW_KEY`, so memory stays bounded whatever the keys. Not thread-safe: call it from
    one event loop (or one thread)."""

    def __init__(self, logger: Any, event: str, *, interval_s: float = 30.0,
                 level: str = "warning", max_keys: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0 or max_keys < 1:
            raise ValueError("interval_s must be >= 0 and max_keys >= 1")
        self._emit: Callable[..., Any] = getattr(logger, level)
        self.event = event
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._next: dict[Hashable, float] = {}  # key -> when it may log again
        self._suppressed: dict[Hashable, int] = {}
        self.total = 0

    def __call__(self, key: Hashable, **fields: Any) -> bool:
        """Log `event` with `fields` unless `key` logged less than `interval_s` ago; True
        when a line was written."""
        self.total += 1
        if key not in self._next and len(self._next) >= self.max_keys:
            key = OVERFLOW_KEY
        now = self._clock()
        if now < self._next.get(key, 0.0):
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._next[key] = now + self.interval_s
        self._emit(self.event, **fields, suppressed=self._suppressed.pop(key, 0))
        return True
