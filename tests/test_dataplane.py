"""The router's compiled data plane (`--data-plane compiled`: router/_dataplane.cc relays local
routes, router.dataplane decides), on a real cluster: Redis, a router, one prefill and two
decode workers as processes, the default model, driven through the router's gRPC API.

- What the extension makes of a worker's TokenChunk is the GenerateResponse the grpc.aio
  servicer makes of it, field for field (protobuf parses both).
- Local routes go through the data plane, text and chat prompts tokenized there too; a remote
  prefill is placed there and run as placed by the grpc.aio server behind it; the rest (a
  bad request, Abort, health) goes through that server; every output is transformers'
  greedy output, token for token.
- SIGKILL or SIGSTOP of the decode worker holding most of 6 streams: every stream finishes
  with the output of an uninterrupted run (the data plane hands each back to Python, which
  migrates it), and every KV block is freed.
- A client that leaves mid-stream has its request cancelled on the worker.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.rpc import convert, transport
from pdserve.v1 import common_pb2, decode_pb2, router_pb2, router_pb2_grpc
from router import dataplane
from router.servicer import _response
from tests.helpers.cluster_util import (
    Stream,
    cluster_fixture,
    decode_stats,
    generate,
    start_streams,
    wait_blocks_free,
)
from tests.helpers.hf import hf_greedy

pytestmark = [
    pytest.mark.skipif(not dataplane.available(),
                       reason="router/_dataplane.cc not built (needs libgrpc++-dev)"),
    pytest.mark.timeout(900),
]

MAX_TOKENS = 48
REMOTE_THRESHOLD = 1000  # the longest test prompt goes remote, the others stay local


cluster = cluster_fixture(decode=2, kv_cache_mb=128, threads=None,
                          router_args=("--data-plane", "compiled", "--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD)))


def _counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def _paths(cluster) -> dict[str, float]:  # type: ignore[no-untyped-def]
    url = f"{cluster.http_url}/metrics"
    return {p: _counter(url, "pdserve_router_data_plane_calls_total", path=p)
            for p in ("routed", "remote", "relayed", "refused", "handed_back")}


def test_responses_are_the_servicers() -> None:
    """router/_dataplane.cc's GenerateResponse from a TokenChunk, against
    router.servicer._response of the TokenEvent the Python path makes of the same chunk."""
    from router import _dataplane

    chunks = [
        decode_pb2.TokenChunk(request_id="r", token_id=42, text="he", num_prompt_tokens=7,
                              num_output_tokens=1),
        decode_pb2.TokenChunk(request_id="r", token_id=0, text="", num_prompt_tokens=7,
                              num_cached_tokens=3, num_output_tokens=2),
        decode_pb2.TokenChunk(request_id="r", token_id=99_999, text="llo wörld",
                              logprob=common_pb2.TokenLogprob(
                                  logprob=-0.25, top=[common_pb2.TopLogprob(
                                      token_id=5, logprob=-1.5)]),
                              finish_reason=common_pb2.FINISH_REASON_LENGTH,
                              num_prompt_tokens=1500, num_cached_tokens=1488,
                              num_output_tokens=300),
        decode_pb2.TokenChunk(request_id="r", finish_reason=common_pb2.FINISH_REASON_ERROR,
                              error="engine failed", num_prompt_tokens=3),
        decode_pb2.TokenChunk(request_id="r", finish_reason=common_pb2.FINISH_REASON_ABORT),
    ]
    request = router_pb2.GenerateRequest(request_id="label-1")
    for chunk in chunks:
        ev = convert.token_event_from_chunk(chunk)
        ev = ev.__class__(**{**ev.__dict__, "route": "local", "decode_worker": "decode-7"})
        want = _response(request, "label-1", ev)
        got = router_pb2.GenerateResponse.FromString(
            _dataplane.encode_response(chunk.SerializeToString(), "label-1", "decode-7"))
        assert got == want, (chunk, got, want)


async def test_routes_and_outputs(cluster, model_dir, prompt_ids, tokenizer) -> None:

    short, long = [list(p) for p in prompt_ids[:2]], list(prompt_ids[-1])
    assert max(len(p) for p in short) < REMOTE_THRESHOLD < len(long)
    want = hf_greedy(model_dir, [*short, long], 16)
    before = _paths(cluster)
    got = [await generate(cluster.grpc_address, p, max_tokens=16) for p in [*short, long]]
    assert [g.tokens for g in got] == want
    assert [g.route for g in got] == ["local", "local", "remote"]
    for g in got:  # StageTimings, asked for by `generate`: timed in C++ on a local route
        assert g.timings is not None and g.timings.first_token_ms > 0, g
    after = _paths(cluster)
    assert after["routed"] - before["routed"] == 2
    # The remote prefill: placed by the data plane, run as placed by the grpc.aio server.
    assert after["remote"] - before["remote"] == 1
    assert after["relayed"] == before["relayed"]
    text = "The capital of France is"
    messages = [{"role": "user", "content": "Name a color."}]
    want = hf_greedy(model_dir, [tokenizer.encode(text),
                                 tokenizer.apply_chat_template(messages)], 8)
    greedy = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    async with transport.insecure_channel(cluster.grpc_address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        # Text and chat prompts, tokenized by the router: routed by the data plane too.
        before = after
        chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(**m) for m in messages])
        for request in (router_pb2.GenerateRequest(text=text, sampling=greedy),
                        router_pb2.GenerateRequest(chat=chat, sampling=greedy)):
            got_text = [r async for r in stub.Generate(request, timeout=120)]
            assert [t for r in got_text for t in r.token_ids] == want.pop(0)
            assert got_text[-1].finish_reason
            assert {r.route for r in got_text if r.route} == {common_pb2.PREFILL_ROUTE_LOCAL}
        after = _paths(cluster)
        assert after["routed"] - before["routed"] == 2
        # Bad requests: INVALID_ARGUMENT with its code in the trailers, as without the
        # data plane (a token-id prompt's relayed to the grpc.aio server, a text prompt's
        # refused by the data plane with the servicer's error).
        for bad in (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=short[0]),
                                               sampling=common_pb2.SamplingParams(max_tokens=0)),
                    router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
                        max_tokens=10**7))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(bad, timeout=60):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert dict(err.value.trailing_metadata() or ()).get("pdserve-error-code")
        assert _paths(cluster)["refused"] - after["refused"] == 1
        # Abort of an unknown request and the health service: relayed.
        assert not (await stub.Abort(common_pb2.AbortRequest(request_id="nobody"),
                                     timeout=10)).found
        health = await health_pb2_grpc.HealthStub(ch).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def _fault(cluster, prompt_ids, sig: signal.Signals) -> None:  # type: ignore[no-untyped-def]

    prompts = [list(p) for p in prompt_ids[:6] if len(p) < REMOTE_THRESHOLD]
    refs = [Stream(ids, MAX_TOKENS) for ids in prompts]
    for s in refs:
        await s.run(cluster.grpc_address)
        assert s.error is None and len(s.tokens) == MAX_TOKENS
    before = _paths(cluster)
    streams, tasks = await start_streams(cluster.grpc_address, prompts, MAX_TOKENS)
    decoders = [n for n in cluster.procs if n.startswith("decode-")]
    running = {n: (await decode_stats(f"127.0.0.1:{cluster.ports[n]}")).num_running
               for n in decoders}
    victim = max(running, key=lambda n: running[n])
    os.kill(cluster.procs[victim].pid, sig)
    at = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
        print(f"\n{sig.name} {victim} (running {running}): streams done "
              f"{time.monotonic() - at:.1f}s later")
    finally:
        if sig == signal.SIGSTOP:
            os.kill(cluster.procs[victim].pid, signal.SIGCONT)
    for s, ref in zip(streams, refs, strict=True):
        assert s.error is None, s.error
        assert s.tokens == ref.tokens and s.text == ref.text
        assert s.decode_worker != victim
    after = _paths(cluster)
    assert after["handed_back"] - before["handed_back"] >= running[victim] >= 1
    if sig == signal.SIGKILL:
        cluster.procs.pop(victim).wait(10)
    for name in cluster.procs:
        if name.startswith(("decode-", "prefill-")) and cluster.procs[name].poll() is None:
            free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports[name]}",
                                                 name.split("-")[0], timeout_s=60)
            assert free == total, (name, free, total)
    if sig == signal.SIGKILL:
        cluster.add_worker("decode", int(victim.split("-")[1]))  # two again


async def test_sigkill_of_a_decode_worker_mid_stream(cluster, prompt_ids) -> None:
    await _fault(cluster, prompt_ids, signal.SIGKILL)


async def test_hung_decode_worker_mid_stream(cluster, prompt_ids) -> None:
    await _fault(cluster, prompt_ids, signal.SIGSTOP)


async def test_a_client_leaving_cancels_its_request(cluster, prompt_ids) -> None:

    async with transport.insecure_channel(cluster.grpc_address) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=list(prompt_ids[0])),
            sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True,
                                               temperature=0.0)), timeout=120)
        got = 0
        async for resp in call:
            got += len(resp.token_ids)
            if got >= 3:
                break
        call.cancel()
    for name in cluster.procs:
        if name.startswith("decode-"):
            free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports[name]}", "decode",
                                                 timeout_s=30)
            assert free == total, (name, free, total)
