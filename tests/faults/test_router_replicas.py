"""Two routers on one Redis serve the same cluster: each keeps its own prefix index from the
same KV events and takes in the other's in-flight counts, and a client naming both
(pdserve.client.RouterClient with a list) loses no request that had not started streaming
when one router is killed."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from pdserve.client import RouterClient, RouterError, Sampling
from pdserve.cluster import LocalCluster
from tests.helpers.cluster_util import cluster_fixture, wait_blocks_free

pytestmark = [pytest.mark.timeout(900)]


cluster = cluster_fixture(kv_cache_mb=96, threads=None, router_args=("--placement", "threshold",
                                                                     "--remote-threshold", "64"))


@pytest.fixture(scope="module")
def replicas(cluster: LocalCluster) -> tuple[LocalCluster, str, str]:
    """The cluster with a second router (router-1): its gRPC address and HTTP URL."""
    grpc_port, http_port = cluster.add_router(1)
    return cluster, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def _index_blocks(url: str) -> float:
    return _metric(url, "pdserve_router_kv_index_blocks")


async def _peers(url: str, want: float, timeout_s: float = 10.0) -> float:
    """The router's count of other routers whose in-flight counts it takes in, once it is
    `want` (or what it is after `timeout_s`)."""
    for _ in range(int(timeout_s / 0.1)):
        if (seen := _metric(url, "pdserve_router_peer_routers")) == want:
            break
        await asyncio.sleep(0.1)
    return seen


async def test_killing_one_router_loses_no_request_that_had_not_started(
        replicas, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    cluster, second_grpc, second_http = replicas
    prompts = [list(p) for p in prompt_ids[:6]]
    sampling = Sampling(max_tokens=8, temperature=0.0)
    async with RouterClient([cluster.grpc_address, second_grpc]) as client:
        before = await asyncio.gather(*(client.complete(token_ids=p, sampling=sampling)
                                        for p in prompts))
        # Both routers folded the same workers' events into their own index.
        for url in (cluster.http_url, second_http):
            for _ in range(50):
                if _index_blocks(url) > 0:
                    break
                await asyncio.sleep(0.1)
            assert _index_blocks(url) > 0, url
        # Each takes in the other's in-flight counts (pdserve.control.inflight).
        assert await _peers(cluster.http_url, 1) == await _peers(second_http, 1) == 1
        cluster.procs["router"].send_signal(signal.SIGKILL)
        cluster.procs["router"].wait(10)
        # Every request sent from now on is served by the replica; none fails.
        after = await asyncio.gather(*(client.complete(token_ids=p, sampling=sampling)
                                       for p in prompts * 2), return_exceptions=True)
    errors = [r for r in after if isinstance(r, BaseException)]
    assert not errors, errors
    for a, b in zip(after, before * 2, strict=True):
        assert not isinstance(a, BaseException) and a.token_ids == b.token_ids
    cluster.procs.pop("router")
    assert await _peers(second_http, 0) == 0  # the killed one's counts lapsed


async def test_a_single_target_client_sees_the_router_go(replicas, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """What a client that names one router sees when it is gone: UNAVAILABLE, retryable."""
    cluster, _, _ = replicas
    async with RouterClient(cluster.grpc_address, timeout_s=10) as client:
        with pytest.raises(RouterError) as err:
            await client.complete(token_ids=list(prompt_ids[0]), sampling=Sampling(max_tokens=2))
    assert err.value.status == "UNAVAILABLE"


async def test_killing_a_router_under_load(replicas, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    """Under load: 8 streams over two replicas, one router SIGKILLed while they run. Every
    stream that had not received a token when it died is served by the other, token for token;
    one that had ends with UNAVAILABLE (what a client sees, and may retry itself); the workers
    free every KV block of the streams that died with their router."""
    cluster, second_grpc, _ = replicas
    third_grpc = f"127.0.0.1:{cluster.add_router(2)[0]}"
    prompts = [list(p[:200]) for p in prompt_ids[:4]] * 2
    sampling = Sampling(max_tokens=40, temperature=0.0)
    async with RouterClient(third_grpc) as solo:  # the reference, from the survivor alone
        reference = [list((await solo.complete(token_ids=p, sampling=sampling)).token_ids)
                     for p in prompts[:4]] * 2
    started = [False] * len(prompts)

    async def run(i: int, client: RouterClient) -> list[int]:
        ids: list[int] = []
        async for chunk in client.generate(token_ids=prompts[i], sampling=sampling):
            started[i] = started[i] or bool(chunk.token_ids)
            ids.extend(chunk.token_ids)
        return ids

    async with RouterClient([second_grpc, third_grpc]) as client:
        tasks = [asyncio.create_task(run(i, client)) for i in range(len(prompts))]
        for _ in range(600):  # kill while some streams run and some have not started
            if any(started):
                break
            await asyncio.sleep(0.05)
        killed_with = list(started)
        cluster.procs["router-1"].send_signal(signal.SIGKILL)
        cluster.procs["router-1"].wait(10)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    cluster.procs.pop("router-1")
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            # Only a stream that was already streaming may fail, and only as UNAVAILABLE.
            assert isinstance(result, RouterError) and result.status == "UNAVAILABLE", result
            assert started[i], f"stream {i} failed before its first token: {result}"
        else:
            assert result == reference[i], i
    print(f"streaming when killed: {killed_with.count(True)} of {len(prompts)}; "
          f"failed: {sum(isinstance(r, BaseException) for r in results)}")
    decode = f"127.0.0.1:{cluster.ports['decode-0']}"
    free, total = await wait_blocks_free(decode, "decode", timeout_s=60)
    assert free == total, (free, total)
