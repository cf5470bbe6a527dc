"""The disaggregated system end to end: real processes, Redis, gRPC, UCX and the model."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from pdserve.cluster import LocalCluster
from pdserve.control.workers import WorkerInfo, this_host, this_nice
from pdserve.rpc import transport as gu
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers.cluster_util import cluster_fixture, generate, wait_blocks_free

REMOTE_THRESHOLD = 64
pytestmark = pytest.mark.timeout(900)


cluster = cluster_fixture(kv_cache_mb=192,
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD)))


def _addr(cluster: LocalCluster, name: str) -> str:
    return f"127.0.0.1:{cluster.ports[name]}"


async def test_outputs_equal_reference_and_routes_are_right(cluster, prompt_ids,
                                                            hf_reference) -> None:
    results = [await generate(cluster.grpc_address, ids) for ids in prompt_ids]
    for ids, ref, res in zip(prompt_ids, hf_reference, results, strict=True):
        assert res.tokens == ref
        expected = "remote" if len(ids) >= REMOTE_THRESHOLD else "local"
        assert res.route == expected, (len(ids), res.route)
    long_remote = results[-1]
    assert long_remote.prefill_worker == "prefill-0"
    assert long_remote.timings is not None and long_remote.timings.kv_transfer_ms > 0
    # The same long prompt again: its prefix is now cached on the decode worker, so it stays
    # local, and the output is still the reference.
    again = await generate(cluster.grpc_address, prompt_ids[-1])
    assert again.route == "local" and again.cached_tokens > 1000
    assert again.tokens == hf_reference[-1]


async def test_a_first_token_past_its_deadline_is_reported_as_that(cluster, tokenizer,
                                                                   model_dir: Path) -> None:
    """With one decode worker, a request whose first token misses the router's first-token
    deadline ends with that error (FIRST_TOKEN_DEADLINE, retryable), not with "no decode
    worker is available" from a second placement with nobody left to try; its blocks are
    freed. An in-process router on the cluster's Redis, with a deadline (20 ms) no prefill of
    63 tokens of this model meets."""
    from pdserve.control import WorkerRegistry
    from pdserve.engine.config import ModelConfig
    from pdserve.errors import ErrorCode, WorkerTimeoutError
    from pdserve.types import GenerateRequest, SamplingParams
    from router.config import RouterConfig
    from router.router import Router

    config = dataclasses.replace(RouterConfig(), first_token_timeout_s=0.02)
    assert cluster.redis_url is not None
    max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    async with (WorkerRegistry.from_url(cluster.redis_url, namespace=cluster.namespace)
                as registry,
                Router(registry, tokenizer, model_name=model_dir.name,
                       max_model_len=max_model_len, config=config, poll_s=0.1) as router):
        deadline = time.monotonic() + 30
        while not router.workers("decode"):
            assert time.monotonic() < deadline, "the router did not list the decode worker"
            await asyncio.sleep(0.1)
        ids = [9000 + (i * 7919) % 20000 for i in range(REMOTE_THRESHOLD - 1)]  # local
        req = GenerateRequest(request_id="late-first-token", prompt_token_ids=tuple(ids),
                              sampling=SamplingParams(max_tokens=4))
        with pytest.raises(WorkerTimeoutError) as err:
            async for _ in router.generate(req):
                pass
    assert err.value.code == ErrorCode.FIRST_TOKEN_DEADLINE, err.value
    free, total = await wait_blocks_free(_addr(cluster, "decode-0"), "decode")
    assert free == total


def _stages(t: common_pb2.StageTimings) -> dict[str, float]:
    return {"route": t.route_ms, "decode_allocate": t.decode_allocate_ms,
            "queued": t.queued_ms, "prefill_compute": t.prefill_compute_ms,
            "kv_transfer": t.kv_transfer_ms, "handoff": t.handoff_ms,
            "remote_attempt": t.remote_attempt_ms, "local_prefill": t.local_prefill_ms}


async def test_stage_timings_add_up_to_ttft(cluster, prompt_ids) -> None:
    """On an idle cluster the stages the router reports add up to the TTFT it reports, none
    is negative, and that TTFT lies within what the client measured (consistency, not speed)."""
    remote_ids = list(prompt_ids[-1])
    remote_ids[1] = 3001  # a prompt nothing has cached: prefilled remotely
    for ids, route in ((remote_ids, "remote"), (prompt_ids[0], "local")):
        res = await generate(cluster.grpc_address, ids, max_tokens=4)
        assert res.route == route and res.timings is not None and res.ttft_s is not None
        t, stages = res.timings, _stages(res.timings)
        print(route, f"client ttft {res.ttft_s * 1000:.1f} ms, reported "
              f"{t.first_token_ms:.1f} ms =", {k: round(v, 1) for k, v in stages.items() if v})
        assert all(v >= 0.0 for v in stages.values()), stages
        assert sum(stages.values()) == pytest.approx(t.first_token_ms, abs=2.0), stages
        assert 0 < t.first_token_ms <= res.ttft_s * 1000 + 1.0
        assert t.first_token_ms <= t.total_ms
        if route == "remote":
            assert t.prefill_compute_ms > 0 and t.kv_transfer_ms > 0 and t.decode_allocate_ms > 0
        else:
            assert t.local_prefill_ms > 0 and t.kv_transfer_ms == 0


async def test_remote_first_token_keeps_top_logprobs(cluster, prompt_ids) -> None:
    """The first token's hand-over (the KV notice) carries its top alternatives."""
    ids = list(prompt_ids[-1])
    ids[1] = 3002
    res = await generate(cluster.grpc_address, ids, max_tokens=2, logprobs=3)
    assert res.route == "remote"
    assert len(res.logprobs) == len(res.tokens) == 2
    for tok, lp in zip(res.tokens, res.logprobs, strict=True):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy: the sampled token is the most likely


async def test_concurrent_mixed_requests(cluster, prompt_ids, hf_reference) -> None:
    results = await asyncio.gather(*(generate(cluster.grpc_address, ids) for ids in prompt_ids))
    for ref, res in zip(hf_reference, results, strict=True):
        assert res.tokens == ref


async def test_forged_and_stale_descriptors_are_rejected(cluster, prompt_ids) -> None:
    async with gu.insecure_channel(_addr(cluster, "prefill-0")) as ch:
        stub = prefill_pb2_grpc.PrefillWorkerStub(ch)
        for descriptor in ("decode-0:999999", "forged", "nobody:1"):
            req = prefill_pb2.PrefillRequest(
                input=common_pb2.GenerateInput(
                    request_id=f"forged-{descriptor}", prompt_token_ids=prompt_ids[0],
                    sampling=common_pb2.SamplingParams(max_tokens=1)),
                destination=prefill_pb2.KVDestination(descriptor_id=descriptor, block_ids=[0],
                                                      transfer_id="t"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Prefill(req, timeout=30)
            assert info.value.code() != grpc.StatusCode.OK
            assert "descriptor" in (info.value.details() or "").lower()


async def test_blocks_return_to_initial(cluster) -> None:
    for name in ("decode-0", "prefill-0"):
        free, total = await wait_blocks_free(_addr(cluster, name), name.split("-")[0])
        assert free == total, name


@pytest.fixture
def own_cluster(model_dir) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(prefill=1, decode=1, model=str(model_dir),
                      extra_worker_args=("--threads", "1", "--kv-cache-mb", "192"),
                      router_args=("--placement", "threshold",
                                   "--remote-threshold", str(REMOTE_THRESHOLD))) as c:
        yield c


async def test_prefill_worker_killed_mid_flight_falls_back(own_cluster, prompt_ids,
                                                           hf_reference) -> None:
    c = own_cluster
    long_ids, ref = prompt_ids[-1], hf_reference[-1]
    # Distinct long prompts so none is served from the decode worker's prefix cache.
    variants = [[ids_tok for ids_tok in long_ids] for _ in range(3)]
    for i, v in enumerate(variants):
        v[1] = 1000 + i  # change an early token: a different prompt, nothing cached
    tasks = [asyncio.create_task(generate(c.grpc_address, v, max_tokens=16)) for v in variants]
    tasks.append(asyncio.create_task(generate(c.grpc_address, long_ids)))
    await asyncio.sleep(1.0)
    c.stop("prefill-0", signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 600)
    assert all(r.finish_reason for r in results)
    assert results[-1].tokens == ref
    assert {r.route for r in results} <= {"remote", "fallback"}
    assert any(r.route == "fallback" for r in results)
    free, total = await wait_blocks_free(f"127.0.0.1:{c.ports['decode-0']}", "decode")
    assert free == total
    # With the prefill pool gone, long prompts are prefilled locally.
    await asyncio.sleep(4)  # lease TTL
    res = await generate(c.grpc_address, [*long_ids[:-5], 5, 6, 7, 8, 9], max_tokens=4)
    assert res.route == "local"


async def test_decode_workers_join_and_drain(own_cluster, prompt_ids, hf_reference) -> None:
    c = own_cluster
    c.add_worker("decode", 1)
    deadline = time.monotonic() + 60
    seen: set[str] = set()
    while time.monotonic() < deadline and "decode-1" not in seen:
        res = await asyncio.gather(*(generate(c.grpc_address, ids, max_tokens=4)
                                     for ids in prompt_ids[:4]))
        seen |= {r.decode_worker for r in res}
    assert "decode-1" in seen, seen
    # SIGTERM decode-0 while streams run on it: they all finish; new requests go elsewhere.
    streams = [asyncio.create_task(generate(c.grpc_address, ids, max_tokens=32))
               for ids in prompt_ids[:6]]
    await asyncio.sleep(1.5)
    loop = asyncio.get_running_loop()
    stopped = loop.run_in_executor(None, c.stop, "decode-0", signal.SIGTERM, 120)
    results = await asyncio.gather(*streams)
    for ids, ref, r in zip(prompt_ids[:6], hf_reference[:6], results, strict=True):
        assert r.tokens == ref, (len(ids), r.decode_worker)
    assert await stopped == 0
    after = await asyncio.gather(*(generate(c.grpc_address, ids, max_tokens=4)
                                   for ids in prompt_ids[:4]))
    assert {r.decode_worker for r in after} == {"decode-1"}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_workers_share_cores_by_priority_and_idle_quietly(cluster) -> None:
    """Decode gets the CPUs at normal priority; prefill shares them at a lower one (no hard
    split that halves decode); an idle worker does not spin a core (ucxx busy-polling)."""
    decode, prefill = cluster.procs["decode-0"].pid, cluster.procs["prefill-0"].pid
    assert os.sched_getaffinity(decode) == os.sched_getaffinity(0)
    assert os.getpriority(os.PRIO_PROCESS, decode) == os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, prefill) == os.getpriority(
        os.PRIO_PROCESS, 0) + cluster.prefill_nice
    before = {pid: _cpu_seconds(pid) for pid in (decode, prefill)}
    time.sleep(3)
    for pid, t0 in before.items():
        busy = (_cpu_seconds(pid) - t0) / 3
        assert busy < 0.25, f"idle worker {pid} used {busy:.0%} of a core"


def test_workers_publish_where_they_compute(cluster) -> None:
    """Each worker's record says its host and CPUs (what cost placement prices sharing by);
    on `cluster up`'s layout the prefill worker shares the decode worker's CPUs."""
    client = redis.Redis.from_url(str(cluster.redis_url), socket_timeout=5)
    records = {}
    for name in ("decode-0", "prefill-0"):
        raw = client.get(f"pdserve:{cluster.namespace}:worker:{name}")
        assert raw is not None, name
        records[name] = WorkerInfo.from_json(raw)  # the signature is verified elsewhere
    decode, prefill = records["decode-0"], records["prefill-0"]
    assert decode.host_id == prefill.host_id == this_host() != ""
    assert decode.cpus == tuple(sorted(os.sched_getaffinity(cluster.procs["decode-0"].pid)))
    assert prefill.shares_cpus(decode)
    assert (prefill.nice - decode.nice, decode.nice) == (cluster.prefill_nice, this_nice())
    assert prefill.stall_share(decode) == pytest.approx(1.25 ** -cluster.prefill_nice)

