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

Router replicas: each router's own counts (`own_placed`, `own_finished`) go to the others
through Redis (pdserve.control.inflight): `merge` takes in all of theirs as an exchange read
them, `take` one router's as it pushed them, and `placed` and `finished`, what placement
reads, are this router's plus theirs. Another router's `finished` for a worker counts only
while this router holds the same load of that worker (`load_tag`): both take departures off
the same heartbeat's count.
"""

from __future__ import annotations

import collections
import json
import time
import zlib
from collections.abc import Callable, Iterable, Mapping

from pdserve.control.inflight import InflightCounts
from pdserve.control.load import WorkerLoad


def load_tag(load: WorkerLoad) -> int:
    """The same number in every router for the same load record (CRC-32 of its canonical
    JSON): whether two routers' `finished` counts are taken off the same heartbeat."""
    return zlib.crc32(json.dumps(load.to_dict(), sort_keys=True).encode())


class PlacementLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # worker id -> requests placed there and running: this router's, and with the other
        # routers' (`merge`) what placement reads
        self.own_placed: collections.Counter[str] = collections.Counter()
        self.placed: collections.Counter[str] = collections.Counter()
        # worker id -> prompt tokens placed there for prefill and not done
        self.inflight_tokens: collections.Counter[str] = collections.Counter()
        # worker id -> requests that left it since its last seen load was taken, placed
        # there before that (so that load counted them): this router's, and with the other
        # routers' that left since the same load
        self.own_finished: collections.Counter[str] = collections.Counter()
        self.finished: collections.Counter[str] = collections.Counter()
        # router id -> the other router's counts, as in `placed` and `finished`; and the
        # `finished` of each that counts here (its tag is that of the load held here)
        self._peers: dict[str, InflightCounts] = {}
        self._peer_finished: dict[str, dict[str, int]] = {}
        self.on_change: Callable[[], object] | None = None  # called, with peers, as `place`d
        self._tags: dict[str, int] = {}  # worker id -> load_tag of its load in `_loads`
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
            _down(self.own_placed, where)
            _down(self.placed, where)
            seen = self._loads.get(where)
            if seen is not None and since < seen[1]:  # that load counted it: not any more
                self.own_finished[where] += 1
                self.finished[where] += 1
        if worker_id is not None:
            self._placements[request_id] = (worker_id, self._clock())
            self.own_placed[worker_id] += 1
            self.placed[worker_id] += 1
        if self._peers and self.on_change is not None:  # the other routers want to know
            self.on_change()

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
        renewed = []
        for worker_id, load in loads:
            seen = known.get(worker_id)
            if seen is not None and seen[0] == load:
                fresh[worker_id] = seen
                continue
            fresh[worker_id] = (load, taken_by)
            self._forget(worker_id)
            renewed.append(worker_id)
        if complete:
            for worker_id in known.keys() - fresh.keys():
                self._forget(worker_id)
            self._loads = fresh
        if self._peers:  # the others' departures off the load now held count from now on
            for worker_id in renewed:
                tag = self._tag(worker_id)
                for router_id, counts in self._peers.items():
                    n, their = counts.finished.get(worker_id, (0, None))
                    if n > 0 and their == tag:
                        self._peer_finished[router_id][worker_id] = n
                        self.finished[worker_id] += n

    def _forget(self, worker_id: str) -> None:
        """A worker's load is new (or it is gone): its `finished` counts start again."""
        self.own_finished.pop(worker_id, None)
        self.finished.pop(worker_id, None)
        self._tags.pop(worker_id, None)
        for counted in self._peer_finished.values():
            counted.pop(worker_id, None)

    def _tag(self, worker_id: str) -> int | None:
        tag = self._tags.get(worker_id)
        if tag is None:
            seen = self._loads.get(worker_id)
            if seen is None:
                return None
            tag = self._tags[worker_id] = load_tag(seen[0])
        return tag

    def shared(self) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
        """This router's counts as the other routers take them (`merge`): `placed`, and
        `finished` with the tag of the load each is taken off."""
        finished = {}
        for w, n in self.own_finished.items():
            tag = self._tag(w)
            if tag is not None:
                finished[w] = (n, tag)
        return dict(self.own_placed), finished

    @property
    def peers(self) -> Mapping[str, InflightCounts]:
        """The other routers' counts in `placed` and `finished`, by router id."""
        return self._peers

    def merge(self, others: Iterable[InflightCounts]) -> None:
        """Every other router's counts as an exchange just read them (none: this router's
        own only); a router not among them is dropped."""
        fresh = {o.router_id: o for o in others}
        for router_id in self._peers.keys() - fresh.keys():
            self._drop(router_id)
        for counts in fresh.values():
            if self._peers.get(counts.router_id) is not counts:
                self.take(counts)

    def take(self, counts: InflightCounts) -> None:
        """One other router's counts, in place of those held from it (its push, or its
        record as read): only what moved since is written, the other routers' untouched.
        Its `finished` only where this router holds the load they were taken off."""
        held = self._peers.get(counts.router_id)
        self._peers[counts.router_id] = counts
        _move(self.placed, {} if held is None else held.placed, counts.placed)
        tags = self._tags
        counted = {}
        for w, (n, tag) in counts.finished.items():
            if n > 0 and (tags[w] if w in tags else self._tag(w)) == tag:
                counted[w] = n
        _move(self.finished, self._peer_finished.get(counts.router_id, {}), counted)
        self._peer_finished[counts.router_id] = counted

    def _drop(self, router_id: str) -> None:
        held = self._peers.pop(router_id, None)
        if held is not None:
            _move(self.placed, held.placed, {})
            _move(self.finished, self._peer_finished.pop(router_id), {})

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


def _down(counts: collections.Counter[str], key: str, n: int = 1) -> None:
    counts[key] -= n
    if counts[key] <= 0:
        del counts[key]


def _move(counts: collections.Counter[str], old: Mapping[str, int],
          new: Mapping[str, int]) -> None:
    """`counts` held `old` among its terms: `new` now (entries at 0 or below go)."""
    if old == new:
        return
    for key, n in new.items():
        d = n - old.get(key, 0)
        if d:
            counts[key] += d
            if counts[key] <= 0:
                del counts[key]
    for key in old.keys() - new.keys():
        _down(counts, key, old[key])
