"""Network faults on a DECODE worker (issue 11): one of two decode workers runs in its own
network namespace behind a veth pair (tests/helpers/netfault.py), with streams in flight on it.

    root namespace: redis-server, router, prefill-0 and decode-0 (gRPC and UCX on H)
    namespace:      decode-1 (gRPC and UCX on W; Redis via H)

- Link down (decode-1 partitioned from everything): its lease lapses (3 s TTL), it misses one
  Stats probe (2 s), the router declares it lost and every stream on it resumes on decode-0
  with the tokens already streamed: the client sees a pause, no error, and the output of an
  uninterrupted run, token for token. Link up: decode-1 registers again and serves again.
- The gRPC path alone blackholed (every packet to or from decode-1's gRPC port dropped; Redis
  and UCX pass): decode-1 keeps its lease, so the lease + probe rule does not see it; its
  streams stall until something breaks them: the kernel giving up on the router's
  unacknowledged frames (gRPC sets TCP_USER_TIMEOUT to its 10 s keepalive timeout), the
  keepalive ping (30 s + 10 s), a stall probe in the router, at the latest the token deadline
  (60 s); then they migrate. The stall is printed (run with -s) and recorded in
  docs/RELIABILITY.md.

One cluster for the module. Needs root, `ip netns` and tc htb; skips otherwise. Requests use
remote prefill (`--remote-threshold 1`), so KV bytes cross the veth to decode-1.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster_util import Stream, start_streams, wait_blocks_free
from tests.helpers.netfault import NetCluster, Veth, make_veth, until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MAX_TOKENS = 64
SHORT = 12  # tokens of the requests that check a worker serves again
VICTIM = "decode-1"  # the decode worker behind the veth
STREAMED = range(4)  # prompts streamed when the fault comes
AFTER = (4, 5)  # prompts asked after it
TOKEN_DEADLINE_S = 60.0  # RouterConfig.token_timeout_s
LOAD_SETTLE_S = 2.5  # heartbeats (1 s) and the router's directory poll (0.5 s), with slack


@pytest.fixture(scope="module")
def veth() -> Iterator[Veth]:
    with make_veth() as v:
        yield v


@pytest.fixture(scope="module")
async def net(veth: Veth, tmp_path_factory: pytest.TempPathFactory,
              model_dir: Path) -> AsyncIterator[NetCluster]:
    c = NetCluster(veth, tmp_path_factory.mktemp("net_decode"), model_dir)
    try:
        c.start([("prefill", "prefill-0", False), ("decode", "decode-0", False),
                 ("decode", VICTIM, True)], router_args=("--placement", "threshold",
                                                         "--remote-threshold", "1"))
        await c.wait_ready()
        yield c
    finally:
        veth.clear()
        veth.link(True)
        c.close()


@pytest.fixture(scope="module")
async def refs(net: NetCluster, prompt_ids: list[list[int]]) -> dict[int, Stream]:
    """The uninterrupted output of every prompt used here, from the healthy cluster (as many
    at a time as the faulted runs have)."""
    out = {i: Stream(list(prompt_ids[i]), MAX_TOKENS) for i in (*STREAMED, *AFTER)}
    await asyncio.wait_for(asyncio.gather(*(s.run(net.router) for s in out.values())), 300)
    for s in out.values():
        assert s.error is None and len(s.tokens) == MAX_TOKENS, s.error
    return out


async def _streams_on_victim(net: NetCluster, prompt_ids: list[list[int]]) -> \
        tuple[list[Stream], list[asyncio.Task[None]]]:
    """Streams of the STREAMED prompts, each a few tokens in, at least one of them on VICTIM
    (placement follows load and cache affinity: try again if none landed there)."""
    await until(lambda: _listed(net, VICTIM), 60, f"{VICTIM} listed")
    for _ in range(4):
        streams, tasks = await start_streams(net.router, [prompt_ids[i] for i in STREAMED],
                                             MAX_TOKENS)
        if any(s.decode_worker == VICTIM for s in streams):
            return streams, tasks
        await asyncio.gather(*tasks)
    pytest.fail(f"no stream was placed on {VICTIM} in 4 tries")


async def _listed(net: NetCluster, worker_id: str, present: bool = True) -> bool:
    return (worker_id in await net.listed()) == present


def _assert_identical(streams: list[Stream], refs: dict[int, Stream]) -> None:
    for i, s in zip(STREAMED, streams, strict=True):
        assert s.error is None, s.error  # the client never saw an error
        assert s.tokens == refs[i].tokens  # nothing repeated, nothing missed
        assert s.text == refs[i].text
        assert s.finish_reason == refs[i].finish_reason


async def _all_blocks_free(net: NetCluster) -> list[str]:
    out = []
    for wid, addr in net.addresses.items():
        free, total = await wait_blocks_free(addr, wid.split("-")[0], timeout_s=60)
        assert free == total, (wid, free, total)
        out.append(f"{wid} {free}/{total}")
    return out


async def _served_by_victim_again(net: NetCluster, refs: dict[int, Stream]) -> float:
    """Seconds until VICTIM serves a request again, with the same output as decode-0.

    Each try sends one prompt that no worker has cached (a fresh token in its first block),
    twice at once, to idle workers: with no cache affinity and equal load the router spreads
    the pair, one copy to each decode worker, and greedy outputs must agree. A cached prompt
    would follow its cache to decode-0 every time, and a try right after the last would see
    the load its heartbeats still report (they lag by up to a second)."""
    start = time.monotonic()
    for attempt in itertools.count():
        if time.monotonic() - start >= 90:
            break
        await asyncio.sleep(LOAD_SETTLE_S)
        ids = list(refs[AFTER[0]].ids)
        ids[1] = 3100 + attempt
        pair = [Stream(list(ids), SHORT) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(s.run(net.router) for s in pair)), 120)
        workers = sorted(s.decode_worker for s in pair)
        for s in pair:
            assert s.error is None, (s.error, workers)
            assert len(s.tokens) == SHORT, workers
        assert pair[0].tokens == pair[1].tokens, workers
        if workers == sorted(["decode-0", VICTIM]):
            return time.monotonic() - start
    pytest.fail(f"{VICTIM} served nothing within 90s of being listed again")


async def test_partitioned_decode_worker_streams_migrate(
        net: NetCluster, veth: Veth, refs: dict[int, Stream],
        prompt_ids: list[list[int]]) -> None:
    streams, tasks = await _streams_on_victim(net, prompt_ids)
    moved = [s for s in streams if s.decode_worker == VICTIM]
    before = [len(s.tokens) for s in streams]
    veth.link(False)
    at = time.monotonic()
    try:
        dropped = asyncio.create_task(until(lambda: _listed(net, VICTIM, False), 60,
                                            f"partitioned {VICTIM} dropped"))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        done = time.monotonic() - at
        gone = await dropped
        gap = max(s.longest_gap() for s in moved)
        print(f"\nlink down with {len(moved)} of {len(streams)} streams on {VICTIM}, tokens "
              f"so far {before}; {VICTIM} unlisted after {gone:.1f}s; longest pause "
              f"{gap:.1f}s; all done {done:.1f}s after the link went down")
        _assert_identical(streams, refs)
        assert all(s.decode_worker == "decode-0" for s in moved)  # every one ended elsewhere
        assert done < TOKEN_DEADLINE_S  # what it must beat: lease 3 s + probe 2 s + the rest
    finally:
        veth.link(True)
    back = await until(lambda: _listed(net, VICTIM), 60, f"{VICTIM} listed again")
    served = await _served_by_victim_again(net, refs)
    blocks = await _all_blocks_free(net)
    print(f"link up: {VICTIM} listed again after {back:.1f}s, served a request "
          f"{served:.1f}s later; free/total blocks: {', '.join(blocks)}")


async def test_grpc_path_blackholed_on_a_decode_worker(
        net: NetCluster, veth: Veth, refs: dict[int, Stream],
        prompt_ids: list[list[int]]) -> None:
    streams, tasks = await _streams_on_victim(net, prompt_ids)
    stalled = [s for s in streams if s.decode_worker == VICTIM]
    unlisted: list[float] = []

    async def watch_lease() -> None:  # is VICTIM ever dropped from the router's directory?
        while True:
            if not await _listed(net, VICTIM):
                unlisted.append(time.monotonic() - at)
            await asyncio.sleep(0.5)

    # Every packet to or from decode-1's gRPC port dropped (a zero-length queue), both ways;
    # Redis (heartbeats, load reports) and UCX (KV writes) pass at full speed.
    veth.shape("1mbit", 0, only_ports=(net.ports[VICTIM],))
    at = time.monotonic()
    watcher = asyncio.create_task(watch_lease())
    fresh = Stream(list(prompt_ids[AFTER[0]]), MAX_TOKENS)  # a new request during the fault
    fresh_task = asyncio.create_task(fresh.run(net.router))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks, fresh_task), 300)
        done = time.monotonic() - at
        fresh_took = fresh.arrivals[-1] - at if fresh.arrivals else float("nan")
        dropped = veth.dropped()
    finally:
        watcher.cancel()
        veth.clear()
    gap = max(s.longest_gap() for s in stalled)
    print(f"\ngRPC port of {VICTIM} blackholed with {len(stalled)} of {len(streams)} streams "
          f"on it; {dropped} packets dropped; {VICTIM} unlisted at "
          f"{[round(t, 1) for t in unlisted[:3]] or 'never'}; stalled streams paused "
          f"{gap:.1f}s, ended on {sorted({s.decode_worker for s in stalled})}; all done "
          f"{done:.1f}s after the fault; a new request took {fresh_took:.1f}s on "
          f"{fresh.decode_worker} (error: {fresh.error})")
    _assert_identical(streams, refs)
    assert fresh.error is None and fresh.tokens == refs[AFTER[0]].tokens
    assert not unlisted  # heartbeats pass: the lease never lapsed
    assert done < TOKEN_DEADLINE_S + 60  # the token deadline bounds the stall
    served = await _served_by_victim_again(net, refs)
    blocks = await _all_blocks_free(net)
    print(f"healed: {VICTIM} served a request {served:.1f}s later; free/total blocks: "
          f"{', '.join(blocks)}")
