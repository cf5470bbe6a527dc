"""The OpenAI HTTP API of a real 1P1D cluster: the official `openai` client, parity with the
gRPC Router path, client disconnects, Prometheus metrics on every process, latency classes.

One cluster for the whole module (starting one costs about a minute on a small machine).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import LocalCluster
from pdserve.rpc import transport as gu
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.helpers.cluster_util import (
    cluster_fixture,
    generate,
    wait_blocks_free,
    worker_blocks,
)

REMOTE_THRESHOLD = 64
MAX_TOKENS = 16
TIMINGS = {"X-Pdserve-Timings": "1"}
pytestmark = pytest.mark.timeout(900)


cluster = cluster_fixture(kv_cache_mb=192,
                          # These tests are about labels and routes, not deadlines: a loaded
                          # CI machine must not turn a slow interactive prefill into a 503.
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD),
                                       "--ttft-deadline", "interactive=60"))


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", timeout=300,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _grpc_address(cluster: LocalCluster, name: str) -> str:
    return f"127.0.0.1:{cluster.ports[name]}"


def _uncached(ids: list[int], salt: int) -> list[int]:
    """The same prompt with an early token changed: nothing of it is in any prefix cache."""
    out = list(ids)
    out[1] = 1000 + salt
    return out


# --------------------------------------------------------------------------- parity


async def test_chat_matches_grpc_path(cluster, client, model_name, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name three primary colors."}]
    ids = tokenizer.apply_chat_template(messages)
    ref = await generate(cluster.grpc_address, ids, max_tokens=MAX_TOKENS)

    resp = client.chat.completions.create(model=model_name, messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == ref.text
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.tokens)

    stream = client.chat.completions.create(model=model_name, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == ref.text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == len(ref.tokens)


async def test_short_completion_matches_grpc_path(cluster, client, model_name,
                                                  prompt_ids) -> None:
    ids = prompt_ids[0]
    assert len(ids) < REMOTE_THRESHOLD
    ref = await generate(cluster.grpc_address, ids, max_tokens=MAX_TOKENS)
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
        extra_headers=TIMINGS)
    assert json.loads(raw.headers["x-pdserve-timings"])["route"] == "local"
    resp = raw.parse()
    assert resp.choices[0].text == ref.text
    assert resp.usage is not None and resp.usage.completion_tokens == len(ref.tokens)

    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        if c.choices)
    assert text == ref.text


async def test_long_completion_goes_remote_and_matches_grpc_path(cluster, client, model_name,
                                                                 prompt_ids) -> None:
    ids = prompt_ids[-1]
    assert len(ids) > 1000
    # HTTP first, while nothing of the prompt is cached: it must be prefilled remotely.
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
        extra_headers=TIMINGS)
    info = json.loads(raw.headers["x-pdserve-timings"])
    assert info["route"] == "remote", info
    assert info["timings_ms"]["kv_transfer_ms"] > 0 and info["timings_ms"]["kv_bytes"] > 0
    resp = raw.parse()
    assert resp.model_extra and resp.model_extra["pdserve"]["route"] == "remote"

    ref = await generate(cluster.grpc_address, ids, max_tokens=MAX_TOKENS)
    assert ref.route == "local" and ref.cached_tokens > 1000  # the remote KV is cached now
    assert resp.choices[0].text == ref.text
    assert resp.usage is not None and resp.usage.completion_tokens == len(ref.tokens)

    # Streaming, on a variant nothing has cached: remote as well, with the route in the
    # last chunk, and the same text as the gRPC path gives for that variant.
    variant = _uncached(ids, 1)
    chunks = list(client.completions.create(model=model_name, prompt=variant,
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_headers=TIMINGS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].model_extra and chunks[-1].model_extra["pdserve"]["route"] == "remote"
    ref_variant = await generate(cluster.grpc_address, variant, max_tokens=MAX_TOKENS)
    assert ref_variant.route == "local"  # now cached on the decode worker
    assert text == ref_variant.text


# --------------------------------------------------------------------------- disconnects


async def test_client_disconnect_aborts_on_workers(cluster, model_name, prompt_ids) -> None:
    decode, prefill = _grpc_address(cluster, "decode-0"), _grpc_address(cluster, "prefill-0")
    free_d, total_d = await wait_blocks_free(decode, "decode")
    assert free_d == total_d
    before = _scrape(cluster.metrics_url("decode-0"))
    body = {"model": model_name, "prompt": _uncached(prompt_ids[-1], 2), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{cluster.http_url}/v1/completions", json=body,
                               headers=TIMINGS) as r:
            assert r.status_code == 200
            got = 0
            async for chunk in r.aiter_raw():
                got += chunk.count(b"data: ")
                if got >= 2:
                    break
        # Closed after two chunks: the request must be aborted, not run to 400 tokens.
    assert got >= 2
    for address, role in ((decode, "decode"), (prefill, "prefill")):
        free, total = await wait_blocks_free(address, role, timeout_s=20)
        assert free == total, (role, free, total)
    after = _scrape(cluster.metrics_url("decode-0"))
    # Cancelled (the router closed the stream) or aborted (its Abort RPC came first).
    ended = sum(_delta(before, after, "pdserve_decode_requests_total", kind="remote",
                       outcome=outcome) for outcome in ("cancelled", "abort"))
    assert ended == 1
    # A request that ran to the end would have produced 400 tokens' worth of steps.
    assert _delta(before, after, "pdserve_engine_steps_total") < 300
    # The engine gauges follow the abort (they are not stuck at the last step's numbers).
    assert _value(after, "pdserve_engine_kv_blocks_free") == total_d
    assert _value(after, "pdserve_engine_running_requests") == 0


async def test_client_disconnect_during_remote_prefill_fences_and_frees(
        cluster, model_name, prompt_ids) -> None:
    decode, prefill = _grpc_address(cluster, "decode-0"), _grpc_address(cluster, "prefill-0")
    d0 = _scrape(cluster.metrics_url("decode-0"))
    p0 = _scrape(cluster.metrics_url("prefill-0"))
    body = {"model": model_name, "prompt": _uncached(prompt_ids[-1], 5), "max_tokens": 8,
            "temperature": 0}
    async with httpx.AsyncClient(timeout=300) as http:
        task = asyncio.create_task(http.post(f"{cluster.http_url}/v1/completions", json=body))
        # Leave while the prefill worker computes: the decode blocks wait for KV that
        # never comes.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = await asyncio.to_thread(_scrape, cluster.metrics_url("prefill-0"))
            if _value(s, "pdserve_prefill_running_requests") == 1:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the prefill never started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for address, role in ((decode, "decode"), (prefill, "prefill")):
        free, total = await wait_blocks_free(address, role, timeout_s=30)
        assert free == total, (role, free, total)
    d1 = _scrape(cluster.metrics_url("decode-0"))
    p1 = _scrape(cluster.metrics_url("prefill-0"))
    assert _delta(d0, d1, "pdserve_decode_fenced_transfers_total") == 1
    assert _delta(d0, d1, "pdserve_decode_fenced_blocks_total") > 0
    assert _delta(d0, d1, "pdserve_decode_remote_admissions_total") == 0
    assert _value(d1, "pdserve_decode_quarantined_blocks") == 0
    assert _value(d1, "pdserve_decode_pending_remote_allocations") == 0
    assert _delta(p0, p1, "pdserve_prefill_requests_total", outcome="cancelled") == 1
    assert _value(p1, "pdserve_prefill_running_requests") == 0


# --------------------------------------------------------------------------- metrics


async def test_metrics_on_every_process_move_with_traffic(cluster, client, model_name,
                                                          prompt_ids) -> None:
    urls = {"router": f"{cluster.http_url}/metrics",
            "decode-0": cluster.metrics_url("decode-0"),
            "prefill-0": cluster.metrics_url("prefill-0")}
    before = {name: _scrape(url) for name, url in urls.items()}
    # One local and one remote request, interactive so the class shows up in the labels.
    for ids in (prompt_ids[2], _uncached(prompt_ids[-1], 3)):
        client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0,
                                  extra_headers={"X-Latency-Class": "interactive"})
    after = {name: _scrape(url) for name, url in urls.items()}

    r0, r1 = before["router"], after["router"]
    assert _delta(r0, r1, "pdserve_router_decisions_total", route="local") >= 1
    assert _delta(r0, r1, "pdserve_router_decisions_total", route="remote") == 1
    assert _delta(r0, r1, "pdserve_requests_total", outcome="success",
                  latency_class="interactive") == 2
    assert _delta(r0, r1, "pdserve:time_to_first_token_seconds_count",
                  latency_class="interactive", route="remote") == 1

    d0, d1 = before["decode-0"], after["decode-0"]
    assert _delta(d0, d1, "pdserve_decode_requests_total", kind="local") >= 1
    assert _delta(d0, d1, "pdserve_decode_requests_total", kind="remote") == 1
    assert _delta(d0, d1, "pdserve_decode_remote_admissions_total") == 1
    assert _delta(d0, d1, "pdserve_decode_kv_wait_seconds_count", outcome="landed") == 1
    assert _delta(d0, d1, "pdserve_engine_steps_total") > 0
    for name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                 "pdserve_engine_awaiting_kv_requests", "pdserve_engine_kv_blocks_used",
                 "pdserve_engine_kv_blocks_free", "pdserve_engine_kv_blocks_total",
                 "pdserve:prefix_cache_hits_total", "pdserve_decode_fenced_transfers_total",
                 "pdserve_decode_quarantined_blocks"):
        assert _has(d1, name), name
    assert _value(d1, "pdserve_engine_kv_blocks_total") > 0

    p0, p1 = before["prefill-0"], after["prefill-0"]
    assert _delta(p0, p1, "pdserve_prefill_requests_total", outcome="ok") == 1
    assert _delta(p0, p1, "pdserve_prefill_compute_seconds_count") == 1
    assert _delta(p0, p1, "pdserve_prefill_compute_seconds_sum") > 0
    assert _delta(p0, p1, "pdserve_prefill_kv_transfer_bytes_total") > 0
    assert _delta(p0, p1, "pdserve_prefill_kv_transfer_seconds_count") == 1
    assert _delta(p0, p1, "pdserve_prefill_queue_wait_seconds_count",
                  latency_class="interactive") == 1
    for lc in ("interactive", "standard", "batch"):
        assert _has(p1, "pdserve_prefill_queue_depth", latency_class=lc)
    for name in ("pdserve_prefill_queued_tokens", "pdserve_prefill_running_requests",
                 "pdserve_engine_kv_blocks_free"):
        assert _has(p1, name), name
    assert _value(p1, "pdserve_engine_kv_blocks_free") == \
        _value(p1, "pdserve_engine_kv_blocks_total")  # released after the transfer

    # A transfer that fails is counted by its error code.
    async with gu.insecure_channel(_grpc_address(cluster, "prefill-0")) as ch:
        req = prefill_pb2.PrefillRequest(
            input=common_pb2.GenerateInput(
                request_id=f"forged-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt_ids[0],
                sampling=common_pb2.SamplingParams(max_tokens=1)),
            destination=prefill_pb2.KVDestination(descriptor_id="nobody:1", block_ids=[0],
                                                  transfer_id="t"))
        with pytest.raises(grpc.aio.AioRpcError):
            await prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(req, timeout=60)
    p2 = _scrape(cluster.metrics_url("prefill-0"))
    assert _delta(p1, p2, "pdserve_prefill_kv_transfer_failures_total") == 1
    assert _delta(p1, p2, "pdserve_prefill_requests_total", outcome="failed") == 1

    # The workers advertise their metrics port in their registration.
    assert _advertised_metrics_ports(cluster) == cluster.metrics_ports


async def test_worker_logs_carry_request_id(cluster, client, model_name, prompt_ids) -> None:
    rid = f"test-rid-{uuid.uuid4().hex[:8]}"
    client.completions.create(model=model_name, prompt=_uncached(prompt_ids[-1], 4),
                              max_tokens=2, temperature=0, extra_headers={"X-Request-Id": rid})
    deadline = time.monotonic() + 10
    for name in ("decode-0", "prefill-0"):
        log = cluster.log_dir / f"{name}.log"
        lines: list[dict] = []
        while not lines and time.monotonic() < deadline:
            lines = [json.loads(line) for line in log.read_text().splitlines()
                     if rid in line and line.startswith("{")]
            await asyncio.sleep(0.2)
        assert lines, name
        assert all(entry["request_id"] == rid for entry in lines)
        assert all("prompt" not in entry and "text" not in entry for entry in lines)


# --------------------------------------------------------------------------- latency class


async def test_latency_class_header(cluster, model_name) -> None:
    url = f"{cluster.http_url}/v1/completions"
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as http:
        for lc in ("interactive", "batch"):
            r = await http.post(url, json=body, headers={"X-Latency-Class": lc})
            assert r.status_code == 200
            assert r.headers["x-latency-class"] == lc
        r = await http.post(url, json=body)
        assert r.headers["x-latency-class"] == "standard"
        r = await http.post(url, json=body, headers={"X-Latency-Class": "urgent"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_latency_class" and "urgent" in err["message"]


async def test_blocks_return_to_initial(cluster) -> None:
    for name in ("decode-0", "prefill-0"):
        free, total = await worker_blocks(_grpc_address(cluster, name), name.split("-")[0])
        assert free == total, name


# --------------------------------------------------------------------------- helpers

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(url: str) -> Samples:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, url
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _advertised_metrics_ports(cluster: LocalCluster) -> dict[str, int]:
    r = httpx.get(f"{cluster.http_url}/v1/pdserve/workers", timeout=10)
    return {w["worker_id"]: w["load"]["metrics_port"] for w in r.json()["workers"]}


def _matching(samples: Samples, name: str, labels: dict[str, str]) -> list[float]:
    want = set(labels.items())
    return [v for (n, lab), v in samples.items() if n == name and want <= lab]


def _value(samples: Samples, name: str, **labels: str) -> float:
    return sum(_matching(samples, name, labels))


def _has(samples: Samples, name: str, **labels: str) -> bool:
    return bool(_matching(samples, name, labels))


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)
