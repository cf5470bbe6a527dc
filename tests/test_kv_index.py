"""The router's exact prefix index (router.kv_index) against the engine's real block manager:
every cache change becomes a KV event, events cross the real codec (and real Redis streams in
the last tests), and the index must equal the caches after inserts, evictions, dropped
batches and worker restarts."""

from __future__ import annotations

import asyncio
import gc
import random
import uuid
from array import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.control.kv_events import MAX_OPS_PER_ENTRY, KVEventPublisher, KVEventStreams
from pdserve.control.registry import WorkerRegistry
from pdserve.engine import block_manager
from pdserve.engine.block_manager import BlockManager, block_hashes, hash_block
from pdserve.kv_events import KVEventBatch, KVEventError, KVOp, encode_ops
from router import kv_index
from router.kv_follow import KVIndexFollower
from router.kv_index import Applied, KVIndex

BS = 4
EXTRA = b"model-x"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def batch(seq: int, *ops: tuple[KVOp, bytes], epoch: int = 1, snapshot: bool = False
          ) -> KVEventBatch:
    return KVEventBatch(epoch, seq, BS, tuple(ops), snapshot=snapshot)


S, R = KVOp.STORED, KVOp.REMOVED


# ---------------------------------------------------------------------- the index alone


def test_match_is_the_longest_held_prefix_per_worker() -> None:
    idx = KVIndex()
    assert idx.apply("a", batch(1, (S, h(1)), (S, h(2)), (S, h(3)), snapshot=True)) is Applied.OK
    assert idx.apply("b", batch(1, (S, h(1)), (S, h(3)), snapshot=True)) is Applied.OK
    assert idx.apply("c", batch(1, (S, h(9)), snapshot=True)) is Applied.OK
    assert idx.match([h(1), h(2), h(3), h(4)]) == {"a": 3, "b": 1}
    assert idx.match([h(9)]) == {"c": 1}
    assert idx.match([h(2)]) == {"a": 1}
    assert idx.match([]) == {}
    assert idx.num_blocks == 4 and idx.num_entries == 6


def test_the_index_gives_the_cyclic_gc_nothing_to_walk() -> None:
    """A router's index holds ~1M blocks: in containers the GC tracks, every full collection
    walked them all (86 ms at 1M blocks, each a pause for every request in flight); held
    in dicts of bytes -> int / None it walks none of them, after stores, removals and a
    worker's departure alike."""
    idx = KVIndex()
    idx.apply("a", batch(1, *((S, h(i)) for i in range(50)), snapshot=True))
    idx.apply("b", batch(1, *((S, h(i)) for i in range(0, 50, 2)), snapshot=True))
    idx.apply("a", batch(2, *((R, h(i)) for i in range(10))))
    idx.remove_worker("b")
    idx.apply("c", batch(1, (S, h(3)), snapshot=True))
    assert not gc.is_tracked(idx._holders)
    assert not any(gc.is_tracked(w.held) for w in idx._workers.values())


def test_increments_apply_in_order_and_gaps_resync() -> None:
    idx = KVIndex()
    assert idx.apply("a", batch(2, (S, h(1)))) is Applied.RESYNC  # no snapshot yet
    assert idx.apply("a", batch(1, snapshot=True)) is Applied.OK
    assert idx.apply("a", batch(2, (S, h(1)), (S, h(2)))) is Applied.OK
    assert idx.apply("a", batch(2, (S, h(7)))) is Applied.STALE  # a duplicate
    assert idx.apply("a", batch(3, (R, h(2)), (S, h(2)), (R, h(1)))) is Applied.OK  # in order
    assert idx.held("a") == {h(2)}
    assert idx.apply("a", batch(5, (S, h(3)))) is Applied.RESYNC  # 4 went missing
    assert not idx.synced("a") and idx.held("a") == frozenset() and idx.match([h(2)]) == {}
    assert idx.apply("a", batch(6, (S, h(3)))) is Applied.RESYNC  # still waiting
    assert idx.apply("a", batch(7, (S, h(2)), snapshot=True)) is Applied.OK
    assert idx.apply("a", batch(8, (S, h(3)))) is Applied.OK
    assert idx.held("a") == {h(2), h(3)}


def test_a_new_epoch_must_open_with_a_snapshot_and_old_epochs_are_ignored() -> None:
    idx = KVIndex()
    idx.apply("a", batch(1, (S, h(1)), snapshot=True))
    assert idx.apply("a", batch(2, (S, h(2)), epoch=2)) is Applied.RESYNC
    assert idx.apply("a", batch(1, (S, h(5)), epoch=2, snapshot=True)) is Applied.OK
    assert idx.apply("a", batch(9, (S, h(6)), epoch=1)) is Applied.STALE  # the zombie
    assert idx.apply("a", batch(2, (S, h(6)), epoch=1, snapshot=True)) is Applied.STALE
    assert idx.held("a") == {h(5)}


def test_workers_leave_and_slots_are_reused() -> None:
    idx = KVIndex()
    for i, w in enumerate("abc"):
        idx.apply(w, batch(1, (S, h(1)), (S, h(10 + i)), snapshot=True))
    idx.remove_worker("b")
    assert idx.match([h(1)]) == {"a": 1, "c": 1}
    idx.apply("d", batch(1, (S, h(1)), snapshot=True))
    assert idx.match([h(1), h(10)]) == {"a": 2, "c": 1, "d": 1}
    idx.sync_workers(["d"])
    assert idx.workers == ["d"] and idx.num_blocks == 1


def test_a_worker_claiming_more_blocks_than_allowed_is_dropped() -> None:
    idx = KVIndex(max_blocks_per_worker=3)
    assert idx.apply("a", batch(1, *((S, h(i)) for i in range(4)), snapshot=True)) \
        is Applied.RESYNC
    assert idx.num_blocks == 0


def test_codec_round_trip_and_refusals() -> None:
    b = batch(3, (S, h(1)), (R, h(2)))
    assert KVEventBatch.from_fields(b.to_fields(), max_ops=8) == b
    fields = b.to_fields()
    for bad in ({**fields, b"ops": fields[b"ops"][:-1]},  # truncated op
                {**fields, b"ops": b"?" + bytes(16)},  # unknown op
                {**fields, b"seq": b"-1"}, {**fields, b"snap": b"2"},
                {k: v for k, v in fields.items() if k != b"epoch"}):
        with pytest.raises(KVEventError):
            KVEventBatch.from_fields(bad, max_ops=8)
    with pytest.raises(KVEventError):
        KVEventBatch.from_fields(fields, max_ops=1)  # over the cap
    with pytest.raises(KVEventError):
        encode_ops([(S, b"short")])
    with pytest.raises(KVEventError):
        batch(1, (R, h(1)), snapshot=True)


# ---------------------------------------------------------------------- vs the block manager


class _Worker:
    """A decode worker's prefix cache: the engine's real BlockManager, requests that start,
    compute and finish, and its KV event numbering."""

    def __init__(self, num_blocks: int, epoch: int):
        self.bm = BlockManager(num_blocks, BS, hash_extra=EXTRA, record_events=True)
        self.epoch, self.seq = epoch, 0
        self.live: dict[str, list[int]] = {}

    def next_batch(self, *, snapshot: bool = False) -> KVEventBatch:
        self.seq += 1
        if snapshot:
            ops = tuple((S, x) for x in self.bm.take_snapshot())
        else:
            ops = tuple(self.bm.drain_events())
        return KVEventBatch(self.epoch, self.seq, BS, ops, snapshot=snapshot)

    def run(self, rid: str, ids: list[int]) -> None:
        alloc = self.bm.allocate_prompt(rid, ids, len(ids), max_cached=len(ids) - 1)
        if alloc is None:
            return
        table, _ = alloc
        self.bm.register_full_blocks(rid, ids, len(ids), table)
        self.live[rid] = table

    def finish(self, rid: str) -> None:
        self.bm.free(rid, self.live.pop(rid))


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing prefixes: a few system prompts, each extended by several turns."""
    systems = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    out = []
    for _ in range(n):
        p = list(rng.choice(systems))
        for _ in range(rng.randrange(3)):
            p += [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        out.append(p)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), drop_rate=st.sampled_from([0.0, 0.1, 0.3]),
       restart_rate=st.sampled_from([0.0, 0.05]))
def test_index_equals_the_block_managers_after_random_traffic(
        seed: int, drop_rate: float, restart_rate: float) -> None:
    """Random requests on three workers with small pools (so blocks are evicted), batches
    lost on the way, workers restarted: after each resync the index equals every cache, and
    `match` equals each block manager's own `num_cached_tokens` for every prompt."""
    rng = random.Random(seed)
    names = ["w0", "w1", "w2"]
    workers = {n: _Worker(rng.choice([6, 10, 16]), epoch=1) for n in names}
    idx = KVIndex()
    for n, w in workers.items():
        assert idx.apply(n, w.next_batch(snapshot=True)) is Applied.OK
    prompts = _prompts(rng, 40)
    for step in range(120):
        n = rng.choice(names)
        w = workers[n]
        if rng.random() < restart_rate:  # a new incarnation with an empty cache
            w = workers[n] = _Worker(w.bm.num_blocks, epoch=w.epoch + 1)
            result = idx.apply(n, w.next_batch(snapshot=True))
            assert result is Applied.OK
            continue
        if w.live and rng.random() < 0.5:
            w.finish(rng.choice(list(w.live)))
        else:
            w.run(f"r{step}", rng.choice(prompts))
        b = w.next_batch()
        if rng.random() < drop_rate:
            continue  # lost on the way: the next batch shows a gap
        b = KVEventBatch.from_fields(b.to_fields(), max_ops=MAX_OPS_PER_ENTRY)  # the codec
        if idx.apply(n, b) is Applied.RESYNC:
            assert idx.apply(n, w.next_batch(snapshot=True)) is Applied.OK
    for n, w in workers.items():  # bring every worker up to date, then compare exactly
        if idx.apply(n, w.next_batch()) is Applied.RESYNC:
            idx.apply(n, w.next_batch(snapshot=True))
        assert idx.held(n) == set(w.bm.cached_hashes()), n
    for p in prompts:
        got = idx.match(block_hashes(p, BS, EXTRA))
        assert idx.match_prompt(p, BS, EXTRA) == got  # the router's walk: hashed lazily, in C
        native, kv_index._native_match = kv_index._native_match, None
        try:  # and where the C extension was not built
            assert idx.match_prompt(p, BS, EXTRA) == got
        finally:
            kv_index._native_match = native
        for n, w in workers.items():
            assert got.get(n, 0) * BS == w.bm.num_cached_tokens(p), (n, p)
        _assert_spread(idx, p, got)


def _assert_spread(idx: KVIndex, prompt: list[int], got: dict[str, int]) -> None:
    """`spread` of the walk writes each followed worker's held tokens at its position, in C
    and where the C was not built (walk and spread both in Python)."""
    names = [n for n in idx._ids if n is not None]
    random.Random(len(prompt)).shuffle(names)
    positions = np.full(len(idx._ids), -1, dtype=np.intp)
    for i, n in enumerate(names):
        positions[idx.slot(n)] = i  # type: ignore[index]
    want = [float(got.get(n, 0) * BS) for n in names]
    for native in (True, False):
        saved = kv_index._native_match, kv_index._native_spread
        if not native:
            kv_index._native_match = kv_index._native_spread = None
        try:
            out = np.zeros(len(names))
            kv_index.spread(idx.walk(prompt, BS, EXTRA), positions, out, BS)
            assert out.tolist() == want, native
        finally:
            kv_index._native_match, kv_index._native_spread = saved


def test_slots_past_64_and_128_are_spread_like_the_first() -> None:
    """Masks of 64 bits and more (a 65th worker) are int objects in the walk; their slots get
    their held tokens like the first 64's; a free slot in the middle gets nothing."""
    rng = random.Random(3)
    prompt = [rng.randrange(1000) for _ in range(BS * 12)]
    hashes = block_hashes(prompt, BS, EXTRA)
    idx = KVIndex()
    held = {}
    for i in range(150):
        held[f"w{i}"] = depth = rng.choice([0, 1, 5, 12, i % 13])
        ops = tuple((KVOp.STORED, h) for h in hashes[:depth])
        assert idx.apply(f"w{i}", KVEventBatch(1, 0, BS, ops, snapshot=True)) is Applied.OK
    idx.remove_worker("w70")
    got = idx.match_prompt(prompt, BS, EXTRA)
    assert got == {n: d for n, d in held.items() if d and n != "w70"}
    _assert_spread(idx, prompt, got)


def test_the_c_spread_checks_its_input() -> None:
    from pdserve._blockhash import spread

    pos, out = np.array([1, -1, 0], dtype=np.intp), np.zeros(2)
    spread([(3, 0b101), (1, 0b010)], pos, out, 16.0)
    assert out.tolist() == [48.0, 48.0]  # slot 1 has no position; past the end: none
    spread([(2, 1 << 70)], pos, out, 16.0)  # an int object past every position
    with pytest.raises(IndexError):
        spread([(1, 1)], np.array([5], dtype=np.intp), out, 1.0)
    with pytest.raises(ValueError):
        spread([(1, -1)], pos, out, 1.0)
    with pytest.raises(TypeError):
        spread([(1, 1)], pos, np.zeros(2, dtype=np.float32), 1.0)
    with pytest.raises(TypeError):
        spread([(1, 1)], np.array([0], dtype=np.int32), out, 1.0)
    with pytest.raises(TypeError):
        spread([(1,)], pos, out, 1.0)


# ---------------------------------------------------------------------- hashing in C


def test_the_c_block_hashes_equal_hashlibs() -> None:
    """pdserve/_blockhash.c (built by setup.py; the router's hot path) gives hash_block's
    digests, block by block, and stops where the Python walk stops."""
    assert block_manager._native_chain is not None, "setup.py did not build the C hashing"
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(0, 120)
        ids = [rng.randrange(-(2**31), 2**31) for _ in range(n)]
        bs = rng.choice([1, 2, 16, 17, 32])
        extra = rng.randbytes(rng.randrange(0, 200))
        want: list[bytes] = []
        parent = None
        for i in range(n // bs):
            parent = hash_block(parent, ids[i * bs:(i + 1) * bs], extra)
            want.append(parent)
        assert block_hashes(ids, bs, extra) == want
        assert block_hashes(tuple(ids), bs, extra) == want
        # Packed int32s (the compiled data plane's prompt) are read as they are.
        assert block_hashes(array("i", ids), bs, extra) == want
        assert block_hashes(memoryview(array("i", ids).tobytes()).cast("i"), bs, extra) == want
        raw = memoryview(array("i", ids[: n // bs * bs]).tobytes())
        stop = {h: 1 for h in want[: rng.randrange(len(want) + 1)]}
        assert block_hashes(ids, bs, extra, stop) == block_manager._chain(
            raw, bs * 4, extra, stop)
    with pytest.raises(OverflowError):
        block_hashes([2**31] * 16, 16)
    with pytest.raises(TypeError):
        block_hashes(["a"] * 16, 16)  # type: ignore[list-item]


def test_the_walk_is_the_same_over_packed_ids_and_in_python() -> None:
    """KVIndex.walk (hashing fused with the table walk, in batches of blocks hashed ahead of
    their lookups) gives the same (depth, mask) pairs for a prompt as a tuple of ints, as
    packed int32s and in Python, wherever along a batch some worker's prefix ends."""
    rng = random.Random(11)
    idx = KVIndex()
    prompt = [rng.randrange(50_000) for _ in range(40 * BS + 3)]
    hashes = block_hashes(prompt, BS, EXTRA)
    for k, depth in enumerate((1, 7, 8, 9, 16, 17, 33, 40)):
        assert idx.apply(f"w{k}", batch(1, *((S, x) for x in hashes[:depth]),
                                        snapshot=True)) is Applied.OK
    for cut in range(0, len(prompt) + 1, 5):
        ids = prompt[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(3 * BS))]
        want = idx._pairs(block_hashes(ids, BS, EXTRA, stop=idx._holders))
        assert idx.walk(ids, BS, EXTRA) == want
        assert idx.walk(memoryview(array("i", ids).tobytes()).cast("i"), BS, EXTRA) == want


def test_the_c_block_table_is_a_dict_of_masks() -> None:
    """pdserve._blockhash.BlockTable (the index's holders where built) against a dict under
    random sets, deletes and lookups, with masks past 64 bits and the all-zero digest (its
    empty-slot marker, kept apart); `match` and `chain(stop=)` over it equal theirs over the
    dict, walking prompts some of whose blocks are held."""
    from pdserve._blockhash import BlockTable, chain, match
    rng = random.Random(11)
    table, ref = BlockTable(), {}
    keys = [rng.randbytes(16) for _ in range(3000)] + [bytes(16)]
    for _ in range(60_000):  # grows past several resizes; deletes shift probe runs back
        k, r = rng.choice(keys), rng.random()
        if r < 0.5:
            v = rng.choice([rng.getrandbits(8), rng.getrandbits(64), 1 << rng.randrange(300)])
            table[k] = ref[k] = v
        elif r < 0.8:
            if k in ref:
                del table[k], ref[k]
            else:
                with pytest.raises(KeyError):
                    del table[k]
        else:
            assert table.get(k, 0) == ref.get(k, 0) and (k in table) == (k in ref)
        assert len(table) == len(ref)
    assert sorted(table.items()) == sorted(ref.items()) and sorted(table) == sorted(ref)
    for bad in (b"short", "str", 3):
        with pytest.raises(ValueError):
            table[bad] = 1  # type: ignore[index]
    with pytest.raises(ValueError):
        table[keys[0]] = -1
    assert not gc.is_tracked(table)
    for _ in range(400):
        ids = [rng.randrange(50_000) for _ in range(16 * rng.randrange(20) + rng.randrange(16))]
        held, plain = BlockTable(), {}
        for h in chain(ids, 16, EXTRA):
            if rng.random() < 0.9:
                held[h] = plain[h] = rng.choice(
                    [0, rng.getrandbits(4), rng.getrandbits(64) | 1, rng.getrandbits(100)])
        assert match(ids, 16, EXTRA, held) == match(ids, 16, EXTRA, plain)
        assert chain(ids, 16, EXTRA, held) == chain(ids, 16, EXTRA, plain)


# ---------------------------------------------------------------------- through real Redis


class _EngineSource:
    """What KVEventPublisher reads from an AsyncEngine (take_kv_events, kv_snapshot), here
    straight off a real BlockManager; `version` changes as the engine's stats would."""

    def __init__(self, worker: _Worker):
        self.worker = worker
        self.version = 0

    async def take_kv_events(self) -> list[tuple[KVOp, bytes]] | None:
        bm = self.worker.bm
        return None if bm.events_overflowed else list(bm.drain_events())

    async def kv_snapshot(self) -> list[bytes]:
        return list(self.worker.bm.take_snapshot())


async def _until(cond: object, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_publisher_and_follower_over_real_redis(redis_server: str) -> None:
    """Two workers publish through Redis streams; two routers' followers (replicas on one
    Redis) each keep their index equal to the caches through traffic, a router joining late,
    a malformed entry and a worker restart."""
    ns = f"kv-{uuid.uuid4().hex[:8]}"
    rng = random.Random(7)
    prompts = _prompts(rng, 20)
    async with WorkerRegistry.from_url(redis_server, namespace=ns) as reg:
        streams = KVEventStreams(reg, maxlen=8)
        workers = {"d0": _Worker(12, 1), "d1": _Worker(20, 1)}
        sources = {n: _EngineSource(w) for n, w in workers.items()}
        pubs = {n: KVEventPublisher(streams, sources[n], lambda n=n: sources[n].version,
                                    worker_id=n, epoch=1, block_size=BS, interval_s=0.005,
                                    snapshot_poll_s=0.05, max_ops=5)
                for n in workers}
        for p in pubs.values():
            await p.start()

        def traffic(k: int) -> None:
            for i in range(k):
                n = rng.choice(list(workers))
                w = workers[n]
                if w.live and rng.random() < 0.5:
                    w.finish(rng.choice(list(w.live)))
                else:
                    w.run(f"r{i}-{rng.random()}", rng.choice(prompts))
                sources[n].version += 1

        def equal() -> bool:
            return all(i.synced(n) and i.held(n) == set(w.bm.cached_hashes())
                       for i in (idx, idx2) for n, w in workers.items())

        traffic(60)  # long before the router starts: the streams are trimmed by then
        await asyncio.sleep(0.3)
        idx, idx2 = KVIndex(), KVIndex()
        follower = KVIndexFollower(streams, idx, lambda: list(workers), block_ms=50,
                                   resync_retry_s=0.2)
        follower2 = KVIndexFollower(streams, idx2, lambda: list(workers), block_ms=50,
                                    resync_retry_s=0.2)
        await follower.start()
        await follower2.start()
        try:
            await _until(equal)
            traffic(80)
            await _until(equal)
            # A malformed entry in d0's stream: the index drops d0 and asks for a snapshot.
            resyncs = follower.resyncs_total._value.get()
            await reg.call(reg.redis.xadd(streams.stream_key("d0"), {b"ops": b"junk"}))
            await _until(lambda: follower.resyncs_total._value.get() > resyncs)
            await _until(equal)
            # d1 restarts: a new epoch with an empty cache, its stream reset.
            await pubs["d1"].close()
            workers["d1"] = _Worker(20, 2)
            sources["d1"].worker = workers["d1"]
            pubs["d1"] = KVEventPublisher(streams, sources["d1"], lambda: sources["d1"].version,
                                          worker_id="d1", epoch=2, block_size=BS,
                                          interval_s=0.005, snapshot_poll_s=0.05)
            await pubs["d1"].start()
            traffic(40)
            await _until(equal)
            for p in prompts:
                got = idx.match(block_hashes(p, BS, EXTRA))
                for n, w in workers.items():
                    assert got.get(n, 0) * BS == w.bm.num_cached_tokens(p)
            # d0 leaves the directory: forgotten.
            del workers["d0"]
            await _until(lambda: "d0" not in idx.workers and "d0" not in idx2.workers)
        finally:
            await follower.close()
            await follower2.close()
            for p in pubs.values():
                await p.close()
