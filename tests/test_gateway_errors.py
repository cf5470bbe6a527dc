"""Gateway error paths: status codes and OpenAI error objects, auth, health, timeouts.

The backend is the real engine (EngineBackend); failures the real engine cannot be made to
produce on demand (no capacity, a mid-stream engine error) wrap it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import CapacityError, KVTransferError
from pdserve.gateway.app import GatewayConfig, create_app
from pdserve.gateway.local_backend import EngineBackend
from pdserve.gateway.server import running_server
from pdserve.types import FinishReason, GenerateRequest, TokenEvent
from tests.helpers.engine_util import serving_engine

MODEL = "smol-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hi"}]
OK_COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}


@pytest.fixture(scope="module")
async def engine(loaded_model, tokenizer) -> AsyncIterator[AsyncEngine]:  # type: ignore[no-untyped-def]
    async with serving_engine(loaded_model, tokenizer) as eng:
        yield eng


@contextlib.asynccontextmanager
async def serve(backend: EngineBackend, config: GatewayConfig | None = None,
                **client_kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with running_server(create_app(backend, config)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60, **client_kw) as http:
            yield http


@pytest.fixture(scope="module")
async def http(engine, tokenizer) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    async with serve(EngineBackend(engine, tokenizer, MODEL)) as client:
        yield client


async def wait_all_free(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            s = await engine.stats()
            if s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks:
                return
            await asyncio.sleep(0.05)


def assert_error(r: httpx.Response, status: int, *, code: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "server_error")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def sse_payloads(text: str) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in text.splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------------- 400s

BAD_COMPLETIONS: list[tuple[dict[str, Any], str, str]] = [
    ({"max_tokens": 2}, "prompt", "missing_parameter"),
    ({"prompt": PROMPT, "n": 0}, "n", "invalid_value"),
    ({"prompt": PROMPT, "n": 2, "best_of": 1}, "best_of", "invalid_request"),
    ({"prompt": PROMPT, "best_of": 2, "stream": True}, "best_of", "invalid_request"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
    ({"prompt": PROMPT, "suffix": "x"}, "suffix", "unsupported_parameter"),
    ({"prompt": PROMPT, "logit_bias": {"x": 5}}, "logit_bias", "invalid_request"),
    ({"prompt": PROMPT, "logit_bias": {"1": 500}}, "logit_bias", "invalid_sampling_params"),
    ({"prompt": PROMPT, "logit_bias": {"99999999": 5}}, "logit_bias", "invalid_request"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty",
     "invalid_sampling_params"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty",
     "invalid_sampling_params"),
    ({"prompt": PROMPT, "min_tokens": 5, "max_tokens": 2}, "min_tokens",
     "invalid_sampling_params"),
    ({"prompt": PROMPT, "min_p": "0.1"}, "min_p", "invalid_type"),
    ({"prompt": [PROMPT] * 65}, "prompt", "invalid_request"),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": [1, 10**9]}, "prompt", "invalid_request"),
    ({"prompt": ""}, "prompt", "empty_prompt"),
    ({"prompt": PROMPT, "max_tokens": "16"}, "max_tokens", "invalid_type"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "invalid_sampling_params"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature", "invalid_sampling_params"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p", "invalid_sampling_params"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs", "invalid_sampling_params"),
    ({"prompt": PROMPT, "seed": 2**70}, "seed", "invalid_value"),
    ({"prompt": PROMPT, "stop": [""]}, "stop", "invalid_sampling_params"),
    ({"prompt": PROMPT, "stop": ["a"] * 17}, "stop", "invalid_value"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream", "invalid_type"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_request"),
    ({"prompt": PROMPT, "latency_class": "urgent"}, "latency_class", "invalid_latency_class"),
]

BAD_CHATS: list[tuple[dict[str, Any], str, str]] = [
    ({"messages": []}, "messages", "invalid_messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages", "unsupported_parameter"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages",
     "unsupported_parameter"),
    ({"messages": CHAT, "n": 17}, "n", "invalid_value"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "unsupported_parameter"),
    ({"messages": CHAT, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format",
     "invalid_value"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_request"),
    ({"messages": CHAT, "max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens",
     "invalid_request"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format",
     "invalid_request"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format",
     "invalid_json_schema"),
    ({"messages": CHAT, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_COMPLETIONS)
async def test_bad_completion_requests(http: httpx.AsyncClient, body: dict[str, Any],
                                       param: str, code: str) -> None:
    assert_error(await http.post("/v1/completions", json=body), 400, code=code, param=param)


@pytest.mark.parametrize(("body", "param", "code"), BAD_CHATS)
async def test_bad_chat_requests(http: httpx.AsyncClient, body: dict[str, Any], param: str,
                                 code: str) -> None:
    assert_error(await http.post("/v1/chat/completions", json=body), 400, code=code,
                 param=param)


async def test_malformed_bodies(http: httpx.AsyncClient) -> None:
    for raw in (b"{", b"[1, 2]", b"\xff\xfe", b""):
        assert_error(await http.post("/v1/completions", content=raw), 400, code="invalid_json")


async def test_neutral_values_of_unsupported_fields_are_accepted(http: httpx.AsyncClient) -> None:
    body = {**OK_COMPLETION, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
            "echo": False, "best_of": 1, "logit_bias": {}, "user": "someone", "top_k": -1,
            "stop": "a long stop string, longer than sixteen characters"}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    chat = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}],
                          "name": "me"}],
            "max_tokens": 1, "tools": [], "response_format": {"type": "text"}}
    assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200


async def test_latency_class_errors(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json=OK_COMPLETION, headers={"X-Latency-Class": "x"})
    assert_error(r, 400, code="invalid_latency_class", param="latency_class")
    r = await http.post("/v1/completions", json={**OK_COMPLETION, "latency_class": "batch"},
                        headers={"X-Latency-Class": "interactive"})
    assert_error(r, 400, code="invalid_latency_class", param="latency_class")


async def test_bad_request_id(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json=OK_COMPLETION, headers={"X-Request-Id": "x" * 300})
    assert_error(r, 400, code="invalid_request_id")


async def test_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={**OK_COMPLETION, "model": "gpt-4"})
    assert_error(r, 404, code="model_not_found", param="model")
    assert_error(await http.get("/v1/models/gpt-4"), 404, code="model_not_found")
    # "default" is an alias unless configured away; omitting the model is fine too.
    r = await http.post("/v1/completions", json={**OK_COMPLETION, "model": "default"})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    body = {k: v for k, v in OK_COMPLETION.items() if k != "model"}
    assert (await http.post("/v1/completions", json=body)).status_code == 200


async def test_no_aliases(engine: AsyncEngine, tokenizer: Any) -> None:
    config = GatewayConfig(model_aliases=frozenset(), served_model_name="served")
    async with serve(EngineBackend(engine, tokenizer, MODEL), config) as http:
        r = await http.post("/v1/completions", json={**OK_COMPLETION, "model": "default"})
        assert_error(r, 404, code="model_not_found")
        r = await http.post("/v1/completions", json={**OK_COMPLETION, "model": "served"})
        assert r.status_code == 200 and r.json()["model"] == "served"
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["served"]


async def test_context_length(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
    max_len = engine.max_model_len
    r = await http.post("/v1/completions", json={"prompt": [1] * max_len})
    assert_error(r, 400, code="context_length_exceeded", param="prompt")
    r = await http.post("/v1/completions", json={"prompt": [1] * (max_len - 100),
                                                 "max_tokens": 200})
    assert_error(r, 400, code="context_length_exceeded", param="prompt")
    r = await http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello " * max_len}]})
    assert_error(r, 400, code="context_length_exceeded", param="messages")
    # Fits the context but not this engine's KV pool: the backend refuses it.
    kv_tokens = engine.layout.num_blocks * engine.layout.block_size
    assert kv_tokens + 16 < max_len
    r = await http.post("/v1/completions", json={"prompt": [1] * (kv_tokens + 16),
                                                 "max_tokens": 1, "stream": True})
    assert_error(r, 400, code="context_length_exceeded", param="prompt")


async def test_body_too_large(http: httpx.AsyncClient) -> None:
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    assert_error(await http.post("/v1/completions", content=big), 413, code="request_too_large")

    async def chunked() -> AsyncGenerator[bytes, None]:  # no Content-Length: counted as read
        for i in range(0, len(big), 64 << 10):
            yield big[i:i + (64 << 10)]

    r = await http.post("/v1/completions", content=chunked())
    assert_error(r, 413, code="request_too_large")


async def test_unknown_route_and_method(http: httpx.AsyncClient) -> None:
    assert_error(await http.get("/v1/nothing"), 404, code="not_found")
    assert_error(await http.get("/v1/completions"), 405, code="method_not_allowed")
    assert_error(await http.delete("/v1/models"), 405, code="method_not_allowed")


async def test_canary_after_errors(http: httpx.AsyncClient, engine: AsyncEngine) -> None:
    r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    await wait_all_free(engine)


# ---------------------------------------------------------------------- auth and health


async def test_api_keys(engine: AsyncEngine, tokenizer: Any) -> None:
    config = GatewayConfig(api_keys=frozenset({"k1", "k2"}))
    async with serve(EngineBackend(engine, tokenizer, MODEL), config) as http:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
            assert_error(await http.get("/v1/models", headers=headers), 401,
                         code="invalid_api_key")
            assert_error(await http.post("/v1/completions", json=OK_COMPLETION,
                                         headers=headers), 401, code="invalid_api_key")
            assert_error(await http.get("/v1/nothing", headers=headers), 401)
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200  # open unless configured
        ok = {"Authorization": "Bearer k2"}
        assert (await http.get("/v1/models", headers=ok)).status_code == 200
        assert (await http.get("/metrics", headers=ok)).status_code == 200
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="k1",
                                      max_retries=0) as client:
            resp = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert resp.usage is not None and resp.usage.completion_tokens == 1
        async with openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="k3",
                                      max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    config = GatewayConfig(api_keys=frozenset({"k1"}), metrics_require_auth=True)
    async with serve(EngineBackend(engine, tokenizer, MODEL), config) as http:
        assert_error(await http.get("/metrics"), 401, code="invalid_api_key")
        page = await http.get("/metrics", headers={"Authorization": "Bearer k1"})
        assert page.status_code == 200 and "pdserve:num_requests_running" in page.text


class NotReadyBackend(EngineBackend):
    def ready(self) -> tuple[bool, str]:
        return False, "no decode worker is registered"


async def test_health_not_ready(engine: AsyncEngine, tokenizer: Any) -> None:
    async with serve(NotReadyBackend(engine, tokenizer, MODEL)) as http:
        err = assert_error(await http.get("/health"), 503, code="not_ready")
        assert "decode worker" in err["message"]


@dataclasses.dataclass(frozen=True)
class Worker:
    worker_id: str
    role: str


class DirectoryBackend(EngineBackend):
    def workers(self, role: str) -> list[Worker]:
        return [Worker(f"{role}-0", role)]


async def test_workers_listing(http: httpx.AsyncClient, engine: AsyncEngine,
                               tokenizer: Any) -> None:
    assert_error(await http.get("/v1/pdserve/workers"), 404, code="not_found")
    async with serve(DirectoryBackend(engine, tokenizer, MODEL)) as client:
        r = await client.get("/v1/pdserve/workers")
        assert r.status_code == 200
        assert r.json() == {"workers": [{"worker_id": "prefill-0", "role": "prefill"},
                                        {"worker_id": "decode-0", "role": "decode"}]}


# ---------------------------------------------------------------------- backend failures


class FullBackend(EngineBackend):
    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        raise CapacityError("all decode workers are full")
        yield  # pragma: no cover


async def test_no_capacity_is_503_with_retry_after(engine: AsyncEngine, tokenizer: Any) -> None:
    config = GatewayConfig(retry_after_s=3)
    async with serve(FullBackend(engine, tokenizer, MODEL), config) as http:
        for stream in (False, True):
            r = await http.post("/v1/completions", json={**OK_COMPLETION, "stream": stream})
            assert_error(r, 503, code="no_capacity")
            assert r.headers["retry-after"] == "3"


class FailingBackend(EngineBackend):
    """Two real tokens, then the failure named by the request's stop string."""

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        n = 0
        async for ev in super().generate(req):
            if n == 2:
                if req.sampling.stop == ("raise",):
                    raise KVTransferError("KV transfer from prefill worker failed")
                yield TokenEvent(req.request_id, None, finish_reason=FinishReason.ERROR,
                                 error="decode worker crashed")
                return
            n += 1
            yield ev


async def test_mid_stream_errors(engine: AsyncEngine, tokenizer: Any) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
    async with serve(FailingBackend(engine, tokenizer, MODEL)) as http:
        for stop, code in (("event", "engine_error"), ("raise", "kv_transfer_error")):
            r = await http.post("/v1/completions", json={**body, "stream": True, "stop": stop})
            assert r.status_code == 200
            payloads = sse_payloads(r.text)
            assert payloads[-1] == "[DONE]"
            assert payloads[-2]["error"]["code"] == code
            assert payloads[-2]["error"]["type"] == "server_error"
            assert all("choices" in p for p in payloads[:-2]) and len(payloads) == 4

            r = await http.post("/v1/completions", json={**body, "stop": stop})
            assert_error(r, 500, code=code)
            await wait_all_free(engine)


async def test_request_timeout(engine: AsyncEngine, tokenizer: Any) -> None:
    config = GatewayConfig(request_timeout_s=1.0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    async with serve(EngineBackend(engine, tokenizer, MODEL), config) as http:
        assert_error(await http.post("/v1/completions", json=body), 504, code="timeout")
        await wait_all_free(engine)
        r = await http.post("/v1/completions", json={**body, "stream": True})
        if r.status_code == 200:  # the usual case: the first token came within the second
            payloads = sse_payloads(r.text)
            assert payloads[-2]["error"]["code"] == "timeout" and payloads[-1] == "[DONE]"
        else:
            assert_error(r, 504, code="timeout")
        await wait_all_free(engine)


class SlowCleanupBackend(EngineBackend):
    """Its cleanup awaits, as a router's abort RPC would; records that it completed."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.cleaned: asyncio.Queue[str] = asyncio.Queue()

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        try:
            async for ev in super().generate(req):
                yield ev
        finally:
            await asyncio.sleep(0.05)
            self.cleaned.put_nowait(req.request_id)


async def test_disconnect_lets_backend_cleanup_await(engine: AsyncEngine, tokenizer: Any) -> None:
    backend = SlowCleanupBackend(engine, tokenizer, MODEL)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with serve(backend) as http:
        for rid in ("gone-1", "gone-2"):
            async with http.stream("POST", "/v1/completions", json=body,
                                   headers={"X-Request-Id": rid}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            assert await asyncio.wait_for(backend.cleaned.get(), 5) == rid
        await wait_all_free(engine, timeout_s=5.0)
