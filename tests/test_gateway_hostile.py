"""Hostile input against the REST gateway (issue 13, items 2, 5 and 6), over real HTTP on the
real engine: deeply nested JSON, the OpenAPI contract and its limits, schemathesis fuzzing of
the served schema, and tokenization kept off the event loop.

The servers run on a private event loop in a thread (`loop_thread`), because the fuzzers drive
their examples synchronously. The engine's context is cut to 40 tokens, so every generation a
fuzzer makes valid is short; the published schema says so (its limits are the server's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
import structlog
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.gateway.app import GatewayConfig, create_app
from pdserve.gateway.local_backend import EngineBackend
from pdserve.gateway.server import running_server
from pdserve.types import MAX_LOGPROBS, MAX_REQUEST_ID_LEN, MAX_TEMPERATURE
from tests.helpers.gated_tokenizer import GatedTokenizer
from tests.helpers.loop_thread import serve_in_thread

MODEL = "smol-test"
MAX_MODEL_LEN = 40
KEY = "sk-hostile"
CHAT = [{"role": "user", "content": "Hi"}]


class BrokenBackend(EngineBackend):
    """A backend with a bug: `ready()` raises something no handler maps."""

    def ready(self) -> tuple[bool, str]:
        raise RuntimeError("a bug in the backend")


@dataclass(frozen=True)
class Gateways:
    plain: str
    keyed: str
    gated: str
    broken: str
    gate: GatedTokenizer


@pytest.fixture(scope="module")
def gateways(loaded_model, tokenizer, model_dir) -> Iterator[Gateways]:  # type: ignore[no-untyped-def]
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    @contextlib.asynccontextmanager
    async def serve() -> AsyncIterator[Gateways]:
        model, config, mid = loaded_model
        llm = LLMEngine(model, config, EngineConfig(kv_cache_bytes=16 << 20,
                                                    max_model_len=MAX_MODEL_LEN),
                        model_id=mid, tokenizer=tokenizer)
        gate = GatedTokenizer(model_dir)
        async with AsyncEngine(llm) as eng:
            def app(config: GatewayConfig | None = None, tok: Any = tokenizer,
                    cls: type[EngineBackend] = EngineBackend) -> Any:
                return create_app(cls(eng, tok, MODEL), config)

            async with (running_server(app()) as plain,
                        running_server(app(GatewayConfig(api_keys=frozenset({KEY})))) as keyed,
                        running_server(app(tok=gate)) as gated,
                        running_server(app(cls=BrokenBackend)) as broken):
                yield Gateways(plain.url, keyed.url, gated.url, broken.url, gate)
        assert llm.block_manager.num_free_blocks == llm.layout.num_blocks, "KV blocks leaked"

    with serve_in_thread(serve) as gw:
        yield gw


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------- 2: nested JSON


def nested(depth: int) -> str:
    """A completion body whose `user` field nests lists so the body is `depth` levels deep."""
    return '{"prompt": "x", "user": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_deeply_nested_json_is_a_400(gateways: Gateways) -> None:
    deep = [
        "[" * 1000 + "]" * 1000,  # the body: RecursionError and a 500 before
        "[" * 100_000,  # never closed
        '{"a": ' * 5000 + "1" + "}" * 5000,
        nested(GatewayConfig().max_json_depth + 1),
    ]
    with httpx.Client(base_url=gateways.plain, timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for raw in deep:
                r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
                assert_error(r, 400, "json_too_deep")
        # At the bound the body parses; it is refused for what it says instead.
        r = http.post("/v1/completions", content=nested(GatewayConfig().max_json_depth))
        assert_error(r, 400, "invalid_type")
        for raw in ('{"prompt": NaN}', '{"prompt": "\\ud800"}'):  # not JSON (RFC 8259)
            assert_error(http.post("/v1/completions", content=raw), 400, "invalid_json")
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_unhandled_error_is_an_openai_500_and_one_log_line(gateways: Gateways) -> None:
    with structlog.testing.capture_logs() as logs:
        r = httpx.get(f"{gateways.broken}/health", timeout=30)
    assert_error(r, 500, "internal_error")
    assert r.headers["x-request-id"]
    [entry] = [e for e in logs if e["event"] == "unhandled error"]
    assert entry["log_level"] == "error" and entry["path"] == "/health"
    assert isinstance(entry["exc_info"], RuntimeError)


# ---------------------------------------------------------------------- 5: the OpenAPI schema


def test_schema_and_docs_are_served_without_a_key(gateways: Gateways) -> None:
    with httpx.Client(base_url=gateways.keyed, timeout=30) as http:
        assert_error(http.get("/v1/models"), 401, "invalid_api_key")
        schema = http.get("/openapi.json").json()
        for page in ("/docs", "/redoc"):
            r = http.get(page)
            assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert schema["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}}
    paths = schema["paths"]
    assert set(paths) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                          "/v1/models/{model}", "/health", "/metrics"}
    assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "401" in paths["/v1/chat/completions"]["post"]["responses"]
    assert "security" not in paths["/health"]["get"]
    assert "401" not in paths["/health"]["get"]["responses"]


def _optional(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null member of an optional property's schema."""
    return next(m for m in prop.get("anyOf", [prop]) if m.get("type") != "null")


def test_schema_limits_are_the_servers_limits(gateways: Gateways) -> None:
    with httpx.Client(base_url=gateways.plain, timeout=60) as http:
        schema = http.get("/openapi.json").json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        max_tokens = _optional(props["max_tokens"])["maximum"]
        assert max_tokens == MAX_MODEL_LEN - 1
        assert _optional(props["temperature"])["maximum"] == MAX_TEMPERATURE
        assert _optional(props["logprobs"])["maximum"] == MAX_LOGPROBS
        [rid] = [p for p in schema["paths"]["/v1/models"]["get"]["parameters"]
                 if p["name"] == "X-Request-Id"]
        assert rid["schema"]["maxLength"] == MAX_REQUEST_ID_LEN

        # At each limit the server accepts; one past it, it refuses with a 400.
        prompt = [1] * max_tokens
        ok = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert_error(r, 400, "context_length_exceeded")
        r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": max_tokens + 1})
        assert_error(r, 400, "context_length_exceeded")
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                               "logprobs": MAX_LOGPROBS})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                               "logprobs": MAX_LOGPROBS + 1})
        assert_error(r, 400, "invalid_sampling_params")
        assert http.get("/v1/models", headers={
            "X-Request-Id": "r" * MAX_REQUEST_ID_LEN}).status_code == 200
        assert_error(http.get("/v1/models", headers={
            "X-Request-Id": "r" * (MAX_REQUEST_ID_LEN + 1)}), 400, "invalid_request_id")


# Bounded: about 15 s on two CPU cores. derandomize: the same examples on every run.
FUZZ = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"),
              ("GET", "/metrics")]


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis(gateways: Gateways, method: str, path: str, mode: str) -> None:
    """Cases generated from the served schema: no 5xx, every status documented, every
    response body valid against its documented schema."""
    schema = schemathesis.openapi.from_url(f"{gateways.plain}/openapi.json")
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @FUZZ
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=gateways.plain, timeout=60, checks=[
            not_a_server_error, status_code_conformance, response_schema_conformance])

    run()


# ---------------------------------------------------------------------- 6: tokenizing off the loop


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
])
def test_tokenizing_does_not_block_the_event_loop(gateways: Gateways, path: str,
                                                  body: dict[str, Any]) -> None:
    """While a request's prompt is being tokenized (held there by the gate, as a 5 MB prompt
    would be), the same server answers /health. Were tokenizing on the event loop, /health
    could not answer until the gate timed out, and this would fail at its read timeout."""
    gate = gateways.gate
    gate.arm()
    with httpx.Client(base_url=gateways.gated, timeout=20) as http, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(http.post, path, json=body, timeout=60)
        try:
            assert gate.entered.wait(timeout=30), "the request never reached the tokenizer"
            health = http.get("/health")
        finally:
            gate.release.set()
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        r = pending.result(timeout=60)
    assert r.status_code == 200, r.text
    assert gate.released is True
    assert r.json()["choices"]
