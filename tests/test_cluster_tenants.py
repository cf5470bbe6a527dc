"""Tenants kept apart on a real cluster (issue 21, item 5): two API keys from a keys file plus
an operator key. Neither tenant can abort, observe or collide with the other's requests; a
key's concurrency quota and latency-class ceiling hold over REST and gRPC; the worker list
(internal addresses) needs an admin key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.client import Chunk, RouterClient, RouterError, Sampling
from pdserve.cluster import LocalCluster

OPS = "sk-ops-3f9c2a71d4e8b605"  # --api-key: an operator key (admin), as before
ALICE = "sk-alice-8d41e0c7b2a9f356"  # keys file: one request at a time, standard at most
BOB = "sk-bob-27c5f9e1a0d3b864"  # keys file: a bare line
LONG = Sampling(max_tokens=1000, ignore_eos=True)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("tenants") / "api-keys"
    keys.write_text(f"# tenants\n{ALICE} max_concurrent=1 max_class=standard\n{BOB}\n")
    keys.chmod(0o600)
    with LocalCluster(prefill=0, decode=1, model=str(model_dir),
                      extra_worker_args=("--threads", "1", "--kv-cache-mb", "192"),
                      router_args=("--api-key", OPS, "--api-key-file", str(keys),
                                   "--ttft-deadline", "interactive=60")) as c:
        yield c


async def _completion(http: httpx.AsyncClient, url: str, key: str, max_tokens: int = 4,
                      **headers: str) -> httpx.Response:
    return await http.post(f"{url}/v1/completions", headers={**_auth(key), **headers}, json={
        "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


@contextlib.asynccontextmanager
async def _running(client: RouterClient, request_id: str) -> AsyncIterator[
        AsyncIterator[Chunk]]:
    """A long gRPC generation that has streamed its first token."""
    stream = client.generate(text="Count to a thousand:", sampling=LONG, request_id=request_id)
    first = await anext(stream)
    assert first.request_id == request_id  # the client's own id, echoed
    try:
        yield stream
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def test_workers_endpoint_needs_an_admin_key(cluster: LocalCluster) -> None:
    url = f"{cluster.http_url}/v1/pdserve/workers"
    r = httpx.get(url, headers=_auth(OPS), timeout=10)
    assert r.status_code == 200 and r.json()["workers"], r.text
    for key in (ALICE, BOB):
        r = httpx.get(url, headers=_auth(key), timeout=10)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "permission_denied" and err["type"] == "permission_error"
        assert "127.0.0.1" not in r.text
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=_auth("sk-nobody-0000000000"), timeout=10).status_code == 401


async def test_same_request_id_from_two_keys_does_not_collide(cluster: LocalCluster) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{cluster.http_url}/v1/completions", json=body,
                               headers={**_auth(ALICE), "X-Request-Id": "shared-id"}) as a:
            assert a.status_code == 200
            assert a.headers["x-request-id"] == "shared-id"
            lines = a.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            # Alice's "shared-id" is running: Bob's "shared-id" is another request.
            r = await http.post(f"{cluster.http_url}/v1/completions", json={
                "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}, headers={**_auth(BOB), "X-Request-Id": "shared-id"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "shared-id"
            assert r.json()["id"] == "shared-id"
            assert r.json()["usage"]["completion_tokens"] == 8
            assert (await anext(lines)) is not None  # Alice's stream goes on


async def test_abort_only_by_the_owner_and_quota_per_key(cluster: LocalCluster) -> None:
    url = cluster.http_url
    async with (RouterClient(cluster.grpc_address, api_key=ALICE) as alice,
                RouterClient(cluster.grpc_address, api_key=BOB) as bob,
                httpx.AsyncClient(timeout=300) as http):
        async with _running(alice, "job-1") as stream:
            # Bob cannot abort Alice's request: to him it does not exist.
            assert await bob.abort("job-1") is False
            # Alice is at her quota (1 in flight), over both APIs; Bob is not.
            r = await _completion(http, url, ALICE)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "quota_exceeded"
            assert r.headers["retry-after"]
            with pytest.raises(RouterError) as err:
                await alice.complete(text="hi", sampling=Sampling(max_tokens=2))
            assert (err.value.status, err.value.code) == ("RESOURCE_EXHAUSTED",
                                                          "quota_exceeded")
            r = await _completion(http, url, BOB, **{"X-Request-Id": "job-1"})
            assert r.status_code == 200, r.text
            # Alice's request survived all of that.
            assert (await anext(stream)).token_ids
            # The owner can abort it: the stream ends long before its 1000 tokens.
            assert await alice.abort("job-1") is True
            got = 0
            with contextlib.suppress(RouterError):
                async with asyncio.timeout(60):
                    async for chunk in stream:
                        got += len(chunk.token_ids)
            assert got < 500
        # Her request is over: her quota is free again.
        for _ in range(50):
            r = await _completion(http, url, ALICE)
            if r.status_code != 429:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 200, r.text
        assert await bob.abort("job-1") is False


async def test_latency_class_ceiling_downgrades(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(timeout=300) as http:
        r = await _completion(http, cluster.http_url, ALICE, **{"X-Latency-Class": "interactive"})
        assert r.status_code == 200, r.text
        assert r.headers["x-latency-class"] == "standard"  # her key's ceiling
        r = await _completion(http, cluster.http_url, ALICE, **{"X-Latency-Class": "batch"})
        assert r.headers["x-latency-class"] == "batch"  # below the ceiling: as asked
        r = await _completion(http, cluster.http_url, BOB, **{"X-Latency-Class": "interactive"})
        assert r.headers["x-latency-class"] == "interactive"
