"""In-flight accounting: what this router has placed where and not yet seen finish.

Heartbeats reach the router once a second; between two of them a burst would all land on the
worker that looked idlest. The ledger counts, per worker, the requests this router has placed
there (`placed`) and the prompt tokens it sent there to prefill that have not produced a
first token yet (`inflight_tokens`), so placement sees its own decisions at once. The
simulator (bench/sim) keeps its router's books with the same class.
"""

from __future__ import annotations

import collections


class PlacementLedger:
    def __init__(self) -> None:
        self.placed: collections.Counter[str] = collections.Counter()  # worker id -> requests
        # worker id -> prompt tokens placed there for prefill and not done
        self.inflight_tokens: collections.Counter[str] = collections.Counter()
        self._placements: dict[str, str] = {}  # request id -> decode worker id
        self._charges: dict[str, tuple[str, int]] = {}  # request id -> (worker id, tokens)

    def place(self, request_id: str, worker_id: str | None) -> None:
        """Where a request runs now (None: nowhere), with the per-worker count kept in step."""
        old = self._placements.pop(request_id, None)
        if old is not None:
            self.placed[old] -= 1
            if not self.placed[old]:
                del self.placed[old]
        if worker_id is not None:
            self._placements[request_id] = worker_id
            self.placed[worker_id] += 1

    def charge(self, request_id: str, worker_id: str | None, tokens: int) -> None:
        """Prompt tokens sent to `worker_id` to prefill (None, or 0 tokens: done)."""
        old = self._charges.pop(request_id, None)
        if old is not None:
            self.inflight_tokens[old[0]] -= old[1]
            if self.inflight_tokens[old[0]] <= 0:
                del self.inflight_tokens[old[0]]
        if worker_id is not None and tokens > 0:
            self._charges[request_id] = (worker_id, tokens)
            self.inflight_tokens[worker_id] += tokens

    def charged(self, request_id: str) -> bool:
        """The request's prompt is still being prefilled somewhere."""
        return request_id in self._charges

    def worker_of(self, request_id: str) -> str | None:
        return self._placements.get(request_id)

    def release(self, request_id: str) -> None:
        """The request left its worker (finished, failed or moving on)."""
        self.place(request_id, None)
        self.charge(request_id, None, 0)
