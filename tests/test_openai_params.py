"""OpenAI surface: the exact bodies the standard load tools send get 200s; the sampling
parameters users send (n, best_of, penalties, logit_bias, min_tokens, stop_token_ids, echo,
lists of prompts, continuous usage) work through the gateway on the real engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.gateway.app import GatewayConfig, create_app
from pdserve.gateway.local_backend import EngineBackend
from pdserve.gateway.server import GatewayServer, running_server
from tests.helpers.engine_util import serving_engine

MODEL = "smol-test"
PROMPT = "The capital of France is"
TEXT = [{"type": "text", "text": "Name three colors."}]


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
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        yield client


def sse(text: str) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------------- the load tools' bodies

# The fields each tool's request construction sends (reconstructed from their sources, not
# captured from a live run of the tool; values made small).
TOOL_BODIES: list[tuple[str, str, dict[str, Any]]] = [
    # vllm bench serve --backend openai (vllm/benchmarks/lib/endpoint_request_func.py)
    ("vllm-completions", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 8,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True}),
    # older vllm benchmark_serving.py (backend_request_func.py): temperature, best_of
    ("vllm-completions-old", "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "temperature": 0.0, "best_of": 1,
        "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None, "stream": True,
        "stream_options": {"include_usage": True}}),
    # vllm bench serve --backend openai-chat
    ("vllm-chat", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": TEXT}], "temperature": 0.0,
        "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True}),
    # guidellm OpenAIHTTPBackend text_completions (max_completion_tokens sent on completions too)
    ("guidellm-completions", "/v1/completions", {
        "prompt": PROMPT, "model": MODEL, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 8, "max_completion_tokens": 8, "stop": None, "ignore_eos": True}),
    ("guidellm-chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": TEXT}], "model": MODEL, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 8, "max_completion_tokens": 8, "stop": None, "ignore_eos": True}),
    ("guidellm-completions-nostream", "/v1/completions", {
        "prompt": PROMPT, "model": MODEL, "stream": False, "max_tokens": 8,
        "max_completion_tokens": 8, "stop": None, "ignore_eos": True}),
    # genai-perf --endpoint-type chat --extra-inputs max_tokens/min_tokens/ignore_eos
    ("genai-perf-chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name three colors."}], "model": MODEL,
        "stream": True, "max_tokens": 8, "min_tokens": 8, "ignore_eos": True}),
    # genai-perf --endpoint-type completions: the prompt is a list of one string
    ("genai-perf-completions", "/v1/completions", {
        "prompt": [PROMPT], "model": MODEL, "stream": False, "max_tokens": 8,
        "min_tokens": 8, "ignore_eos": True}),
    # vendor extensions nobody here implements are ignored, as vLLM does
    ("vendor-fields", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "nvext": {"ignore_eos": True}, "foo": 1,
        "use_beam_search": False, "priority": 0, "add_special_tokens": True}),
]


@pytest.mark.parametrize(("path", "body"), [(p, b) for _, p, b in TOOL_BODIES],
                         ids=[name for name, _, _ in TOOL_BODIES])
async def test_load_tool_bodies_get_200(http: httpx.AsyncClient, path: str,
                                        body: dict[str, Any]) -> None:
    r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        out = r.json()
        assert out["usage"]["completion_tokens"] >= 1
        return
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    if options.get("continuous_usage_stats"):
        with_choices = [c for c in chunks if c["choices"]]
        assert all("usage" in c for c in with_choices)
        done = [c["usage"]["completion_tokens"] for c in with_choices]
        assert done == sorted(done) and done[-1] == 8
    if body.get("min_tokens"):
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"


# ---------------------------------------------------------------------- n, best_of, prompts


async def test_n_seeded_children_differ_reproducibly(http: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 7}
    a = (await http.post("/v1/completions", json=body)).json()
    b = (await http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]]
    assert len(set(texts)) > 1
    # child j is the request with seed + j
    one = (await http.post("/v1/completions", json={**body, "n": 1, "seed": 8})).json()
    assert one["choices"][0]["text"] == texts[1]
    assert 3 <= a["usage"]["completion_tokens"] <= 36  # every choice's tokens
    assert a["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt once


async def test_n_streamed_chat(http: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
            "temperature": 0.9, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = sse((await http.post("/v1/chat/completions", json=body)).text)[:-1]
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert finished == {0, 1}
    plain = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    out = (await http.post("/v1/chat/completions", json=plain)).json()
    assert [c["message"]["content"] for c in out["choices"]] == [texts[0], texts[1]]
    assert chunks[-1]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]


async def test_best_of_returns_the_most_likely(http: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3}
    cands = (await http.post("/v1/completions", json={**body, "n": 4, "logprobs": 0})).json()
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in cands["choices"]}
    best = (await http.post("/v1/completions", json={**body, "best_of": 4})).json()
    assert len(best["choices"]) == 1 and best["choices"][0]["index"] == 0
    assert best["choices"][0]["text"] == max(score, key=score.__getitem__)
    assert best["choices"][0]["logprobs"] is None  # not asked for


async def test_prompt_lists(http: httpx.AsyncClient, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = [PROMPT, "One, two, three,"]
    out = (await http.post("/v1/completions", json={
        "prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2})).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = (await http.post("/v1/completions", json={
            "prompt": p, "max_tokens": 6, "temperature": 0})).json()
        assert out["choices"][2 * i]["text"] == alone["choices"][0]["text"]
        assert out["choices"][2 * i + 1]["text"] == alone["choices"][0]["text"]
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = (await http.post("/v1/completions", json={
        "prompt": ids, "max_tokens": 6, "temperature": 0})).json()
    assert [c["text"] for c in by_ids["choices"]] == [
        c["text"] for c in out["choices"][::2]]
    assert by_ids["usage"]["prompt_tokens"] == sum(len(i) for i in ids)


async def test_echo(http: httpx.AsyncClient) -> None:
    out = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True})).json()
    plain = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 4, "temperature": 0})).json()
    assert out["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]


# ---------------------------------------------------------------------- sampling parameters


async def test_stop_token_ids_and_min_tokens(http: httpx.AsyncClient, tokenizer) -> None:  # type: ignore[no-untyped-def]
    plain = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0})).json()
    toks = plain["choices"][0]["logprobs"]["tokens"]
    third = tokenizer.encode(toks[2])[0]
    r = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [third]})).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 3
    held = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [third],
        "min_tokens": 8})).json()
    assert held["usage"]["completion_tokens"] == 8


async def test_include_stop_str_in_output(http: httpx.AsyncClient) -> None:
    plain = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0})).json()["choices"][0]["text"]
    stop = plain.strip().split()[0]
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": [stop]}
    cut = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    kept = (await http.post("/v1/completions", json={
        **body, "include_stop_str_in_output": True})).json()["choices"][0]["text"]
    assert kept == cut + stop


async def test_logit_bias_and_penalties(server: GatewayServer, http: httpx.AsyncClient,
                                        tokenizer) -> None:  # type: ignore[no-untyped-def]
    forced = (await http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100},
        "logprobs": 0})).json()
    assert forced["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([42])] * 3
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                  max_retries=0) as client:
        plain = await client.completions.create(model=MODEL, prompt="one one one one one",
                                                max_tokens=8, temperature=0)
        penalized = await client.completions.create(
            model=MODEL, prompt="one one one one one", max_tokens=8, temperature=0,
            frequency_penalty=2.0, presence_penalty=1.0,
            extra_body={"repetition_penalty": 1.5, "min_p": 0.1})
        assert penalized.choices[0].text != plain.choices[0].text
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
            temperature=0.8, seed=5)
    assert [c.index for c in chat.choices] == [0, 1]


async def test_response_format_json_schema(server: GatewayServer) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                  max_retries=0) as client:
        out = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a city, as JSON."}],
            max_tokens=40, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": schema, "strict": True}})
    assert set(json.loads(out.choices[0].message.content)) == {"city"}
