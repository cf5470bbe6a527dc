"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

Failures never raise: they end up in the `Trace` (and from there in `RequestResult.error`), so
one bad request cannot stop a run. The only exception that escapes is CancelledError, after
which the caller still holds the partial `Trace`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.loadgen.config import RunConfig
from bench.loadgen.errors import TargetError
from bench.loadgen.metrics import RequestResult
from bench.loadgen.workload import RequestSpec

LATENCY_CLASS_HEADER = "X-Latency-Class"


def request_body(config: RunConfig, model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if config.api == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body["max_tokens"] = spec.output_len
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def make_client(
    config: RunConfig, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s, pool=None)
    # Open loop must not queue inside the connection pool: that would hide server queueing.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(
        timeout=timeout,
        limits=limits,
        transport=transport,
        trust_env=False,  # a proxy from the environment must not intercept loopback traffic
        headers=dict(config.headers),
    )


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id from GET /v1/models."""
    try:
        response = await client.get(base_url + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise TargetError(
            f"could not discover the model from {base_url}/v1/models ({exc}); pass --model"
        ) from exc


@dataclass
class Trace:
    """What has been observed of one request so far; `result()` works at any point."""

    spec: RequestSpec
    run_start: float
    sent_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    ended_at: float | None = None
    done: bool = False  # saw `data: [DONE]`
    status: int | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    server_info: dict[str, Any] | None = None  # the "pdserve" object of the last chunk
    retry_after: str | None = None  # the Retry-After header of a non-200 answer
    cancelled: bool = False

    def result(self) -> RequestResult:
        error = self.error
        if self.cancelled:
            error = "unfinished: cancelled when the run reached max_duration_s"
        elif error is None and not self.done:
            error = "stream ended without data: [DONE]"
        if error is None and not self.token_times:
            error = "stream ended without any content"
        usage = self.usage or {}
        output_tokens = int(usage.get("completion_tokens") or len(self.token_times))
        sent = self.sent_at if self.sent_at is not None else self.run_start
        first = self.token_times[0] if self.token_times else None
        info = self.server_info or {}
        timings = info.get("timings_ms")
        return RequestResult(
            index=self.spec.index,
            latency_class=self.spec.latency_class,
            prompt_tokens=int(usage.get("prompt_tokens") or self.spec.prompt_len),
            max_tokens=self.spec.output_len,
            output_tokens=output_tokens,
            start_s=sent - self.run_start,
            ttft_s=None if first is None else first - sent,
            e2e_s=None if self.ended_at is None else self.ended_at - sent,
            itl_s=tuple(
                b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)
            ),
            status=self.status,
            error=error,
            route=info.get("route"),
            server_timings_ms=(
                {str(k): float(v) for k, v in timings.items()}
                if isinstance(timings, dict)
                else None
            ),
            retry_after_s=_seconds(self.retry_after),
        )


def _seconds(value: str | None) -> float | None:
    """A Retry-After value in seconds (the HTTP-date form is not parsed)."""
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


def _error_message(payload: bytes) -> str:
    try:
        body = json.loads(payload)
        err = body.get("error", body) if isinstance(body, dict) else body
        message = err.get("message") if isinstance(err, dict) else None
        if message is None and isinstance(body, dict):
            message = body.get("detail")
        return str(message if message is not None else body)[:500]
    except (ValueError, AttributeError):
        return payload.decode(errors="replace")[:500]


async def stream_request(
    client: httpx.AsyncClient, config: RunConfig, model: str, trace: Trace
) -> None:
    spec = trace.spec
    headers = {LATENCY_CLASS_HEADER: spec.latency_class}
    body = request_body(config, model, spec)
    trace.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", config.endpoint, json=body, headers=headers) as response:
            trace.status = response.status_code
            if response.status_code != 200:
                trace.retry_after = response.headers.get("Retry-After")
                message = _error_message(await response.aread())
                trace.error = f"HTTP {response.status_code}: {message}"
                return
            await _consume_sse(response, trace)
    except asyncio.CancelledError:
        trace.cancelled = True
        raise
    except httpx.HTTPError as exc:
        trace.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        trace.ended_at = time.perf_counter()


async def _consume_sse(response: httpx.Response, trace: Trace) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            trace.done = True
            return
        now = time.perf_counter()
        try:
            chunk = json.loads(data)
        except ValueError:
            trace.error = f"malformed SSE data: {data[:200]}"
            return
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            trace.error = "stream error: " + _error_message(data.encode())
            return
        if chunk.get("usage"):
            trace.usage = chunk["usage"]
        if isinstance(chunk.get("pdserve"), dict):  # sent when asked with X-Pdserve-Timings: 1
            trace.server_info = chunk["pdserve"]
        if _chunk_text(chunk):
            trace.token_times.append(now)
