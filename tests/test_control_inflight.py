"""Router replicas' in-flight counts (pdserve.control.inflight) on a real redis-server: each
router writes its own and reads the others' in one round trip; a router that stops drops out
within its ttl; with a cluster secret an unsigned or foreign record is never taken in; a
malformed one is dropped, never half-read. And what placement makes of them: two routers'
ledgers (router.ledger) exchanging counts no longer send two arrivals to the same worker."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.control import WorkerInfo, WorkerRegistry
from pdserve.control.inflight import (
    MAX_WORKERS,
    InflightBoard,
    InflightCounts,
    InflightRecordError,
    new_router_id,
    newest,
)
from pdserve.control.load import WorkerLoad
from pdserve.control.signing import signer_for
from pdserve.rpc.auth import ClusterSecret
from pdserve.types import LatencyClass
from router.kv_index import KVIndex
from router.ledger import PlacementLedger, load_tag
from router.placement import place
from router.policy import RouterPolicy

SECRET = ClusterSecret(b"inflight-test-" + uuid.uuid4().hex.encode())
OTHER = ClusterSecret(b"an-attackers-own-secret-" + uuid.uuid4().hex.encode())


async def test_routers_read_each_others_counts_and_a_stopped_one_drops_out(
        registry: WorkerRegistry) -> None:
    a = InflightBoard(registry, "router-a", ttl_s=0.3)
    b = InflightBoard(registry, "router-b", ttl_s=5.0)
    assert await a.exchange({"d0": 2}, {"d1": (1, 77)}) == []  # alone so far
    (seen,) = await b.exchange({"d1": 1}, {})
    assert (seen.router_id, seen.placed, seen.finished) == ("router-a", {"d0": 2},
                                                             {"d1": (1, 77)})
    (seen,) = await a.exchange({}, {})
    assert (seen.router_id, seen.placed, seen.finished) == ("router-b", {"d1": 1}, {})
    await asyncio.sleep(0.5)  # a stops writing: its key lapses, b prunes it
    assert await b.exchange({}, {}) == []
    assert await registry.redis.smembers(registry.key("routers")) == {b"router-b"}
    await b.leave()  # a clean stop takes it off at once
    assert await a.exchange({}, {}) == []
    assert await registry.redis.smembers(registry.key("routers")) == {b"router-a"}


async def test_a_push_reaches_the_followers_at_once(registry: WorkerRegistry) -> None:
    """`push` publishes what it writes; `follow` hands each other router's record over as
    it comes (its own, coming back, is dropped unread), even after an idle spell
    longer than the client's socket timeout; of two records the later wins (`newest`)."""
    a, b = InflightBoard(registry, "router-a"), InflightBoard(registry, "router-b")
    got: asyncio.Queue[InflightCounts] = asyncio.Queue()
    follower = asyncio.create_task(b.follow(got.put_nowait))
    try:
        for _ in range(100):  # subscribed once a push arrives
            await a.push({"d0": 1}, {})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    first = await got.get()
                    break
        await b.push({"d9": 9}, {})  # its own: not handed over
        await asyncio.sleep(registry.op_timeout_s + 0.5)  # idle past the socket timeout
        assert not b._written  # its own came back and was dropped unread
        await a.push({"d0": 2}, {"d1": (1, 5)})
        async with asyncio.timeout(5):
            second = await got.get()
        while not got.empty():
            second = got.get_nowait()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    assert first.router_id == "router-a" and second.placed == {"d0": 2}
    assert second.seq > first.seq and second.finished == {"d1": (1, 5)}
    assert newest([first], {"router-a": second}) == {"router-a": second}
    assert newest([second], {"router-a": first, "gone": first}) == {"router-a": second}


def _record(**fields: object) -> str:
    return json.dumps({"router": "r", "seq": 1, "placed": {}, "finished": {}, **fields})


@pytest.mark.parametrize("record", [
    "not json", "[1, 2]", _record(router="x y"), _record(seq=-1), _record(seq="1"),
    _record(placed={"d0": -1}), _record(placed={"d0": True}), _record(placed={"d0": 1.5}),
    _record(placed={"d0": 1 << 40}), _record(placed={"": 1}), _record(finished={"d0": 1}),
    _record(finished={"d0": [1, -1]}), _record(placed=None),
    _record(placed={f"d{i}": 1 for i in range(MAX_WORKERS + 1)}),
])
async def test_a_malformed_record_is_dropped_whole(registry: WorkerRegistry,
                                                   record: str) -> None:
    await registry.redis.set(registry.key("inflight:r"), record, px=10_000)
    await registry.redis.sadd(registry.key("routers"), "r")
    assert await InflightBoard(registry, "router-a").exchange({}, {}) == []
    await registry.redis.set(registry.key("inflight:r"), _record(placed={"d0": 1}), px=10_000)
    (valid,) = await InflightBoard(registry, "router-a").exchange({}, {})
    assert valid.placed == {"d0": 1}


def test_records_round_trip_and_refuse_what_they_cannot_hold() -> None:
    counts = InflightCounts("r-1", {"d0": 3}, {"d0": (2, 9)}, seq=4)
    assert InflightCounts.from_dict(json.loads(json.dumps(counts.to_dict()))) == counts
    with pytest.raises(InflightRecordError):
        InflightCounts.from_dict({"router": "r", "placed": {"d0": 1}})  # no finished
    assert len(new_router_id()) <= 128
    with pytest.raises(ValueError, match="router id"):
        InflightBoard(None, "a router")  # type: ignore[arg-type]


async def test_with_a_secret_only_a_members_record_counts(redis_server: str,
                                                          namespace: str) -> None:
    async with WorkerRegistry.from_url(redis_server, namespace=namespace,
                                       signer=signer_for(SECRET, namespace)) as member, \
            WorkerRegistry.from_url(redis_server, namespace=namespace,
                                    signer=signer_for(OTHER, namespace)) as outsider, \
            WorkerRegistry.from_url(redis_server, namespace=namespace) as unsigned:
        await InflightBoard(outsider, "forged").exchange({"d0": 100}, {})
        await InflightBoard(unsigned, "plain").exchange({"d0": 100}, {})
        await InflightBoard(member, "peer").exchange({"d1": 1}, {})
        seen = await InflightBoard(member, "me").exchange({}, {})
        assert [(c.router_id, c.placed) for c in seen] == [("peer", {"d1": 1})]


def _decoder(wid: str, running: float) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="decode", grpc_address="127.0.0.1:1", model_id="m",
                      epoch=1, started_at=0.0,
                      load=WorkerLoad(running=running, free_blocks=100, total_blocks=100))


@pytest.mark.parametrize("policy", ["threshold", "cost"])
def test_two_routers_sharing_counts_do_not_herd(policy: str) -> None:
    """Two routers, two idle decode workers: an arrival at each, one after the other, went
    both to the same worker (each saw the other's only in the next heartbeat); with the
    counts shared they go one to each. And a request of the other router that left a worker
    since its heartbeat no longer makes it look busy, but only while both hold that load."""
    now = [0.0]
    rp = RouterPolicy(placement=policy)  # type: ignore[arg-type]
    one, two = PlacementLedger(lambda: now[0]), PlacementLedger(lambda: now[0])
    a, b = _decoder("a", 0), _decoder("b", 0)

    def choose(ledger: PlacementLedger, decoders: list[WorkerInfo] = [a, b]) -> str:  # noqa: B006
        return place(list(range(100)), LatencyClass.INTERACTIVE, decoders, [], KVIndex(),
                     ledger.placed, rp, tiebreak=0, finished=ledger.finished).decode.worker_id

    def exchange() -> None:
        one.merge([InflightCounts("two", *two.shared())])
        two.merge([InflightCounts("one", *one.shared())])

    pushes: list[str] = []
    one.on_change = lambda: pushes.append("one")
    first = choose(one)
    one.place("r1", first)
    assert choose(two) == first  # not shared: the same worker
    assert not pushes  # alone so far: nobody to push to
    exchange()
    assert len(two.peers) == 1 and two.placed == {first: 1}
    second = choose(two)
    assert second != first
    two.place("r2", second)
    one.place("r9", first)
    one.release("r9")
    assert pushes == ["one", "one"]  # with a peer, each change is pushed
    exchange()
    assert one.placed == two.placed == {"a": 1, "b": 1}
    assert one.own_placed == {first: 1}

    # Both workers' heartbeats now count their request; then two's leaves.
    a, b = _decoder("a", 1), _decoder("b", 1)
    now[0] = 1.0
    for ledger in (one, two):
        ledger.saw_loads([("a", a.load), ("b", b.load)], 0.35)
    now[0] = 1.5
    two.release("r2")
    assert two.finished == {second: 1}
    exchange()
    assert one.finished == {second: 1} and one.placed == {first: 1}
    assert choose(one, [a, b]) == second  # it left: that worker is the idle one
    # A router that took a newer load of that worker does not take two's count off it.
    newer = WorkerLoad(running=1, free_blocks=99, total_blocks=100)
    assert load_tag(newer) != load_tag(b.load) == load_tag(_decoder("b", 1).load)
    one.saw_loads([(second, newer)], 0.35, complete=False)
    exchange()
    assert not one.finished
    one.merge(())  # Redis away past the ttl: its own counts only
    assert not one.peers and one.placed == {first: 1}


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["place", "release", "loads", "some_loads",
                                                "take", "merge"]),
                               st.integers(0, 2**31 - 1)), max_size=80))
def test_taking_one_routers_counts_keeps_the_views_exact(ops: list[tuple[str, int]]) -> None:
    """`take` (one router's push: its own counts out, its new ones in) and `merge` (all of
    them, as an exchange read them) against the views rebuilt from scratch after every step:
    `placed` is this router's plus every peer's, `finished` this router's plus every peer's
    taken off the load this router holds now, whatever the order of placements, new
    heartbeats, pushes and exchanges."""
    import random

    now = [0.0]
    ledger = PlacementLedger(lambda: now[0])
    workers = ["w0", "w1", "w2"]
    loads = {w: WorkerLoad(running=0, free_blocks=100, total_blocks=100) for w in workers}
    held: dict[str, InflightCounts] = {}
    seq = 0
    for op, seed in ops:
        rng = random.Random(seed)
        now[0] += rng.choice([0.0, 0.5])
        if op == "place":
            ledger.place(f"r{rng.randrange(6)}", rng.choice(workers))
        elif op == "release":
            ledger.release(f"r{rng.randrange(6)}")
        elif op in ("loads", "some_loads"):
            for w in rng.sample(workers, rng.randint(1, 3)):
                loads[w] = WorkerLoad(running=rng.randrange(4), free_blocks=100,
                                      total_blocks=100)
            some = rng.sample(workers, rng.randint(1, 3))
            ledger.saw_loads([(w, loads[w]) for w in (some if op == "some_loads" else workers)],
                             0.1, complete=op == "loads")
        else:
            seq += 1
            tags = [load_tag(loads[w]) for w in workers] + [123]
            router = rng.choice(["p", "q"])
            counts = InflightCounts(
                router, {w: rng.randrange(3) for w in rng.sample(workers, rng.randint(0, 3))},
                {w: (rng.randrange(3), rng.choice(tags))
                 for w in rng.sample(workers, rng.randint(0, 3))}, seq)
            if op == "take":
                ledger.take(counts)
                held[router] = counts
            else:
                held = {r: c for r, c in {**held, router: counts}.items()
                        if rng.random() < 0.7}
                ledger.merge(held.values())
        assert set(ledger.peers) == set(held)
        placed = collections.Counter(ledger.own_placed)
        finished = collections.Counter(ledger.own_finished)
        for counts in held.values():
            placed.update({w: n for w, n in counts.placed.items() if n > 0})
            for w, (n, tag) in counts.finished.items():
                seen = ledger._loads.get(w)
                if n > 0 and seen is not None and load_tag(seen[0]) == tag:
                    finished[w] += n
        assert ledger.placed == +placed
        assert ledger.finished == +finished


async def test_a_lone_router_only_renews_and_a_new_one_is_seen_at_once(
        registry: WorkerRegistry, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Two in-process routers (router.router) on one Redis, no workers. Alone, a router
    renews its record a few times per lease, not every `share_inflight_s` (each exchange
    with nobody cost the router harness's light phase its decisions per CPU-second); a
    second router still counts as its peer at once, from the published first exchange, and
    from then on they exchange on the short period."""
    from router.config import RouterConfig
    from router.router import LONE_RENEWALS_PER_TTL, Router

    config = RouterConfig(share_inflight_s=0.02)  # lease: 2 s, renewed every 0.67 s alone
    exchanges: dict[str, int] = {}

    def counted(router: Router) -> None:
        board = router.inflight_board
        assert board is not None
        real = board.exchange

        async def exchange(*args, **kwargs):  # type: ignore[no-untyped-def]
            exchanges[router.router_id] = exchanges.get(router.router_id, 0) + 1
            return await real(*args, **kwargs)
        board.exchange = exchange  # type: ignore[method-assign]

    def make() -> Router:
        router = Router(registry, tokenizer, model_name="m", max_model_len=2048,
                        config=config, poll_s=0.1)
        counted(router)
        return router

    async with make() as one:
        lone_s = one.inflight_board.ttl_ms / 1000 / LONE_RENEWALS_PER_TTL  # type: ignore[union-attr]
        await asyncio.sleep(1.0)
        # the first at the start, then one renewal: not 1.0 / 0.02 = 50
        assert 1 <= exchanges[one.router_id] <= 1 + 1.0 / lone_s
        async with make() as two:
            t0 = asyncio.get_running_loop().time()
            while len(one.ledger.peers) != 1 or len(two.ledger.peers) != 1:
                assert asyncio.get_running_loop().time() - t0 < 0.5, "the peer was not seen"
                await asyncio.sleep(0.01)
            before = exchanges[one.router_id]
            await asyncio.sleep(0.5)
            assert exchanges[one.router_id] - before >= 10  # on the short period again
        t0 = asyncio.get_running_loop().time()
        while one.ledger.peers:  # two left cleanly; one's next exchange no longer lists it
            assert asyncio.get_running_loop().time() - t0 < 0.5
            await asyncio.sleep(0.01)
