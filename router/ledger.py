"""In-flight accounting: what this router has placed where and not yet seen finish.

Heartbeats reach the router once a second; between two of them a burst would all land on the
worker that looked idlest. The ledger counts, per worker, the requests this router has placed
there (`placed`) and the prompt tokens it sent there to prefill that have not produced a
first token yet (`inflight_tokens`), so placement sees its own decisions at once.

The other way round too: a worker whose requests just ended still counts them running until
its next heartbeat, and the arrivals of that second would all land elsewhere (two closed-loop
streams on two decode workers both went to one, then both to the other, turn by turn:
docs/bench/placement_s79). So the ledger also counts, per worker, this router's requests
that left it since the load it last saw from it was taken and that this load counted
(`finished`; placement takes those off its running count). The simulator (bench/sim) keeps
its router's books with the same class.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from pdserve.control.load import WorkerLoad


class PlacementLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.placed: collections.Counter[str] = collections.Counter()  # worker id -> requests
        # worker id -> prompt tokens placed there for prefill and not done
        self.inflight_tokens: collections.Counter[str] = collections.Counter()
        # worker id -> requests that left it since its last seen load was taken, placed
        # there before that (so that load counted them)
        self.finished: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._placements: dict[str, tuple[str, float]] = {}  # request id -> (worker, when)
        self._charges: dict[str, tuple[str, int]] = {}  # request id -> (worker id, tokens)
        # worker id -> (the load last seen from it, the earliest it can have been taken)
        self._loads: dict[str, tuple[WorkerLoad, float]] = {}

    def place(self, request_id: str, worker_id: str | None) -> None:
        """Where a request runs now (None: nowhere), with the per-worker counts kept in step."""
        old = self._placements.pop(request_id, None)
        if old is not None:
            where, since = old
            self.placed[where] -= 1
            if not self.placed[where]:
                del self.placed[where]
            seen = self._loads.get(where)
            if seen is not None and since < seen[1]:  # that load counted it: not any more
                self.finished[where] += 1
        if worker_id is not None:
            self._placements[request_id] = (worker_id, self._clock())
            self.placed[worker_id] += 1

    def saw_loads(self, loads: Iterable[tuple[str, WorkerLoad]], age_s: float, *,
                  complete: bool = True) -> None:
        """Loads as the router sees them now, each taken at most `age_s` ago, less the way a
        request takes to the worker's count (the directory's poll period and a margin): a
        worker whose load is new starts its `finished` count again, and a request placed
        there before that time counts as finished once it leaves. `complete`: these are
        every worker's (the directory's), and the others are forgotten.
        Where a request reached the worker only after its load was taken (a remote prefill
        still computing) and ends before the next one, it is taken off once too often until
        that next load: never below what this router has placed there."""
        taken_by = self._clock() - age_s
        known = self._loads
        fresh: dict[str, tuple[WorkerLoad, float]] = {} if complete else known
        for worker_id, load in loads:
            seen = known.get(worker_id)
            if seen is not None and seen[0] == load:
                fresh[worker_id] = seen
                continue
            fresh[worker_id] = (load, taken_by)
            self.finished.pop(worker_id, None)
        if complete:
            for worker_id in known.keys() - fresh.keys():
                self.finished.pop(worker_id, None)
            self._loads = fresh

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
        old = self._placements.get(request_id)
        return None if old is None else old[0]

    def release(self, request_id: str) -> None:
        """The request left its worker (finished, failed or moving on)."""
        self.place(request_id, None)
        self.charge(request_id, None, 0)
