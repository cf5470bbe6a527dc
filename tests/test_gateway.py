"""The REST gateway against the real default model through EngineBackend, over real HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.async_engine import AsyncEngine
from pdserve.gateway.app import GatewayConfig, create_app
from pdserve.gateway.local_backend import EngineBackend
from pdserve.gateway.server import GatewayServer, running_server
from pdserve.types import GenerateRequest, SamplingParams
from tests.helpers.engine_util import serving_engine

MODEL = "smol-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
async def engine(loaded_model, tokenizer) -> AsyncIterator[AsyncEngine]:  # type: ignore[no-untyped-def]
    async with serving_engine(loaded_model, tokenizer) as eng:
        yield eng


@pytest.fixture(scope="module")
async def server(engine, tokenizer) -> AsyncIterator[GatewayServer]:  # type: ignore[no-untyped-def]
    app = create_app(EngineBackend(engine, tokenizer, MODEL), GatewayConfig())
    async with running_server(app) as srv:
        yield srv


@pytest.fixture
async def http(server: GatewayServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture
async def client(server: GatewayServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                  max_retries=0) as client:
        yield client


async def direct_text(engine: AsyncEngine, ids: list[int], max_tokens: int, rid: str) -> str:
    req = GenerateRequest(rid, tuple(ids), SamplingParams(max_tokens=max_tokens))
    return "".join([ev.text async for ev in engine.generate(req)])


async def wait_all_free(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            s = await engine.stats()
            if s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks:
                return
            await asyncio.sleep(0.05)


def sse_payloads(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# ---------------------------------------------------------------------- OpenAI client


async def test_openai_completions_match_engine(client, engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    expected = await direct_text(engine, tokenizer.encode(PROMPT), 8, "direct-cmpl")
    resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                           temperature=0)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "length"
    assert resp.model == MODEL and resp.id.startswith("cmpl-")
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        len(tokenizer.encode(PROMPT)), 8)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8

    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_openai_chat_matches_engine(client, engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    expected = await direct_text(engine, tokenizer.apply_chat_template(CHAT), 8, "direct-chat")
    resp = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                                temperature=0)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens_details is not None
    # Same prompt again: its full blocks now come from the prefix cache.
    assert resp.usage.prompt_tokens_details.cached_tokens > 0

    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8


async def test_prompt_forms_and_stop(client, engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer.encode(PROMPT)
    expected = await direct_text(engine, ids, 6, "direct-forms")
    for prompt in (ids, [PROMPT]):
        resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                               temperature=0)
        assert resp.choices[0].text == expected
    stop = expected.strip().split()[1]  # a word from inside the expected output
    resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                           temperature=0, stop=stop)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == expected[: expected.index(stop)]


async def test_logprobs_shapes(client) -> None:  # type: ignore[no-untyped-def]
    resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                           temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == resp.choices[0].text

    chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                                temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy


async def test_sampling_with_seed_is_reproducible(client) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9,
                              top_p=0.9, seed=1234, extra_body={"top_k": 40})
    a = await client.completions.create(**kw)
    b = await client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


async def test_models(client) -> None:  # type: ignore[no-untyped-def]
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL


# ---------------------------------------------------------------------- headers


async def test_request_id_latency_class_and_timings(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = await http.post("/v1/completions", json=body, headers={
        "X-Request-Id": "my-req-1", "X-Latency-Class": "Interactive", "X-Pdserve-Timings": "1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "my-req-1" and r.json()["id"] == "my-req-1"
    assert r.headers["x-latency-class"] == "interactive"
    info = json.loads(r.headers["x-pdserve-timings"])
    assert info == r.json()["pdserve"]
    assert info["route"] == "local"
    assert 0 < info["timings_ms"]["ttft_ms"] <= info["timings_ms"]["total_ms"]

    r = await http.post("/v1/completions", json={**body, "latency_class": "batch"})
    assert r.headers["x-latency-class"] == "batch"
    assert r.headers["x-request-id"].startswith("cmpl-")
    assert "pdserve" not in r.json() and "x-pdserve-timings" not in r.headers

    r = await http.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "stream": True}, headers={"X-Pdserve-Timings": "1"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["pdserve"]["route"] == "local"
    assert all("pdserve" not in p for p in payloads[:-2])
    assert r.headers["x-request-id"].startswith("chatcmpl-")


# ---------------------------------------------------------------------- cancellation


async def test_disconnect_mid_stream_frees_blocks(server: GatewayServer, engine) -> None:  # type: ignore[no-untyped-def]
    await wait_all_free(engine)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    break
            s = await engine.stats()
            assert s.running == 1 and s.free_blocks < s.total_blocks
    # The connection is closed; the request must be aborted long before 400 tokens.
    await wait_all_free(engine, timeout_s=5.0)


async def test_disconnect_while_waiting_non_streaming(server: GatewayServer, engine) -> None:  # type: ignore[no-untyped-def]
    await wait_all_free(engine)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    await wait_all_free(engine, timeout_s=5.0)


# ---------------------------------------------------------------------- metrics


async def test_metrics_move_with_traffic(http: httpx.AsyncClient) -> None:
    before = (await http.get("/metrics")).text
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3},
                        headers={"X-Latency-Class": "batch"})
    assert r.status_code == 200
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1},
                        headers={"X-Latency-Class": "batch"})
    assert r.status_code == 400
    page = await http.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    after = page.text

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("pdserve_requests_total", outcome="success", latency_class="batch") == 1
    assert delta("pdserve_requests_total", outcome="rejected", latency_class="batch") == 1
    for hist in ("pdserve:time_to_first_token_seconds", "pdserve:e2e_request_latency_seconds",
                 "pdserve:request_decode_time_seconds"):
        assert delta(hist + "_count", latency_class="batch", route="local") == 1
    assert delta("pdserve:inter_token_latency_seconds_count", latency_class="batch",
                 route="local") == 2
    assert delta("pdserve:generation_tokens_total", model_name=MODEL) == 3
    assert delta("pdserve:prompt_tokens_total") > 0
    assert delta("pdserve:request_generation_tokens_sum") == 3
    assert delta("pdserve:request_prompt_tokens_count") == 1
    assert delta("pdserve:request_success_total", finished_reason="length") == 1
    assert "pdserve_cached_prompt_tokens_total" in after
    assert metric_value(after, "pdserve_requests_in_flight", latency_class="batch") == 0
    # Engine gauges from the backend's collector share the page.
    assert metric_value(after, "pdserve_engine_kv_blocks_total", worker="local") > 0
    assert delta("pdserve_engine_steps_total", worker="local") >= 3
    assert delta("pdserve:prefix_cache_queries_total", worker="local") > 0
    assert delta("pdserve:request_queue_time_seconds_count", worker="local") == 1
    for name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                 "pdserve:kv_cache_usage_perc", "pdserve:prefix_cache_hits_total",
                 "pdserve:num_preemptions_total", "pdserve_engine_kv_blocks_free",
                 "pdserve_engine_kv_blocks_used"):
        assert name in after


async def test_health(http: httpx.AsyncClient) -> None:
    r = await http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_logs_carry_request_id_not_text(http: httpx.AsyncClient) -> None:
    secret = "Zanzibar-quokka"
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs:
        r = await http.post("/v1/completions", json={"prompt": secret, "max_tokens": 2},
                            headers={"X-Request-Id": "log-me"})
        assert r.status_code == 200
        r = await http.post("/v1/completions", json={"prompt": secret, "suffix": "x"},
                            headers={"X-Request-Id": "log-me-too"})
        assert r.status_code == 400
    finished = [e for e in logs if e["event"] == "request finished"]
    assert [e["request_id"] for e in finished] == ["log-me"]
    assert finished[0]["outcome"] == "success" and finished[0]["output_tokens"] == 2
    assert any(e.get("request_id") == "log-me-too" and e["event"] == "request rejected"
               for e in logs)
    assert secret not in repr(logs)


async def test_bodies_are_the_protocol_models(http: httpx.AsyncClient) -> None:
    """Every body the gateway sends parses as its protocol model and dumps back to the same
    JSON: the models that generate /openapi.json are the wire format (nulls and absent
    optional fields included)."""
    from pdserve.gateway.protocol import (
        Body,
        ChatCompletion,
        ChatCompletionChunk,
        Completion,
        CompletionChunk,
        ErrorResponse,
        ModelList,
    )

    def same(model: type[Body], sent: dict[str, Any]) -> None:
        assert model.model_validate(sent).body() == sent

    for path, fields, whole, chunk in (
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 1}, Completion, CompletionChunk),
            ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 1},
             ChatCompletion, ChatCompletionChunk)):
        body = {**fields, "max_tokens": 4, "temperature": 0}
        r = await http.post(path, json=body, headers={"X-Pdserve-Timings": "1"})
        assert r.status_code == 200, r.text
        assert "pdserve" in r.json()
        same(whole, r.json())
        r = await http.post(path, json={**body, "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert events and "usage" in events[-1] and not events[-1]["choices"]
        for event in events:
            same(chunk, event)
        r = await http.post(path, json={**body, "temperature": "hot"})
        assert r.status_code == 400
        same(ErrorResponse, r.json())
    same(ModelList, (await http.get("/v1/models")).json())
