"""A typed asyncio client for the router's gRPC API (`pdserve.v1.Router`).

It needs only ``grpcio`` and ``protobuf`` besides the generated stubs in `pdserve.v1`, so it
works from the light client distribution (clients/python: `pip install ./clients/python`)
as well as from the full `pdserve` install. Nothing here imports torch, ucxx or the engine.

    async with RouterClient("127.0.0.1:50051") as client:
        async for chunk in client.generate(text="Once upon a time",
                                           sampling=Sampling(max_tokens=32)):
            print(chunk.text, end="")
        result = await client.complete(messages=[("user", "Hi!")])

Failures raise `RouterError` with the gRPC status name and pdserve's stable error code
(the ``pdserve-error-code`` trailer, e.g. ``context_length_exceeded``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

import grpc

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

__all__ = ["Chunk", "Completion", "RouterClient", "RouterError", "Sampling", "Usage",
           "tls_credentials"]

LatencyClass = Literal["interactive", "standard", "batch"]
FinishReason = Literal["stop", "length", "abort", "error"]
Route = Literal["local", "remote", "fallback", ""]

_LATENCY = {"interactive": common_pb2.LATENCY_CLASS_INTERACTIVE,
            "standard": common_pb2.LATENCY_CLASS_STANDARD,
            "batch": common_pb2.LATENCY_CLASS_BATCH}
_FINISH: dict[int, FinishReason] = {common_pb2.FINISH_REASON_STOP: "stop",
                                    common_pb2.FINISH_REASON_LENGTH: "length",
                                    common_pb2.FINISH_REASON_ABORT: "abort",
                                    common_pb2.FINISH_REASON_ERROR: "error"}
_ROUTE: dict[int, Route] = {common_pb2.PREFILL_ROUTE_LOCAL: "local",
                            common_pb2.PREFILL_ROUTE_REMOTE: "remote",
                            common_pb2.PREFILL_ROUTE_FALLBACK: "fallback"}
ERROR_CODE_KEY = "pdserve-error-code"


@dataclass(frozen=True)
class Sampling:
    """Decoding controls; None leaves a field to the server's default. The server validates
    (INVALID_ARGUMENT -> RouterError with code ``invalid_request``-style error codes)."""

    max_tokens: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def to_proto(self) -> common_pb2.SamplingParams:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields["stop"], fields["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        fields["logit_bias"] = dict(self.logit_bias)
        return common_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """One streamed response: the tokens and text new in it, with running usage."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    usage: Usage
    finish_reason: FinishReason | None = None  # set on the last chunk only
    error: str = ""  # with finish_reason "error": why the engine failed
    route: Route = ""
    decode_worker: str = ""
    prefill_worker: str = ""


@dataclass(frozen=True)
class Completion:
    """A whole generation, as `RouterClient.complete` returns it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    usage: Usage
    route: Route = ""


class RouterError(Exception):
    """A failed router call: `status` is the gRPC status name (e.g. ``UNAVAILABLE``),
    `code` pdserve's stable error code when the server sent one."""

    def __init__(self, status: str, code: str, message: str):
        super().__init__(f"{status}{f' ({code})' if code else ''}: {message}")
        self.status, self.code, self.message = status, code, message

    @classmethod
    def from_rpc(cls, exc: grpc.aio.AioRpcError) -> RouterError:
        code = next((str(v) for k, v in exc.trailing_metadata() or () if k == ERROR_CODE_KEY),
                    "")
        return cls(exc.code().name, code, exc.details() or "")


def _chunk(resp: router_pb2.GenerateResponse) -> Chunk:
    return Chunk(request_id=resp.request_id, token_ids=tuple(resp.token_ids), text=resp.text,
                 usage=Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens,
                             resp.usage.cached_tokens),
                 finish_reason=_FINISH.get(resp.finish_reason), error=resp.error,
                 route=_ROUTE.get(resp.route, ""), decode_worker=resp.decode_worker,
                 prefill_worker=resp.prefill_worker)


def replicas_target(addresses: Sequence[str]) -> str:
    """One gRPC target naming several routers by IP (``ipv4:a:p,b:p`` / ``ipv6:...``), or
    one ``host:port`` whose DNS name resolves to every replica (a headless Service):
    ``dns:///host:port``, every address it resolves to a replica."""
    hosts = [a.rpartition(":")[0].strip("[]") for a in addresses]
    try:
        versions = {ipaddress.ip_address(h).version for h in hosts}
    except ValueError:
        if len(addresses) == 1:
            return f"dns:///{addresses[0]}"
        raise ValueError("several router addresses must be IP:port; for host names use one "
                         "DNS name that resolves to every replica") from None
    if len(versions) != 1:
        raise ValueError("router addresses must all be IPv4 or all IPv6")
    return f"ipv{versions.pop()}:" + ",".join(addresses)


# Several routers behind one channel: requests spread over them (round robin), and one that
# fails with UNAVAILABLE before any response reached us (a router that is down, or refused it
# while draining) is retried on another by gRPC itself. A stream that has started is never
# retried: it ends with the error (its tokens could not be replayed exactly by the client).
# gRPC commits a call to its attempt once the server's response headers arrive, and a router
# killed while it writes a stream's first response can leave the headers with the client and
# the response itself lost ("Stream removed"): gRPC then will not retry it, though the caller
# has seen nothing. `RouterClient.generate` sends such a stream again itself (up to
# _STREAM_ATTEMPTS calls in all, within the one timeout, a jittered pause between them).
_REPLICAS_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": "pdserve.v1.Router"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
})
_STREAM_ATTEMPTS = 3
_BACKOFF_S = 0.05


def tls_credentials(ca: str, cert: str | None = None,
                    key: str | None = None) -> grpc.ChannelCredentials:
    """Channel credentials for a router on TLS: trust the CA certificate(s) in the PEM file
    `ca` only; present `cert` (PEM chain) with its `key` where the router asks for a client
    certificate (``--tls-client-auth require``)."""
    with open(ca, "rb") as f:
        root = f.read()
    if cert is None or key is None:
        return grpc.ssl_channel_credentials(root_certificates=root)
    with open(cert, "rb") as c, open(key, "rb") as k:
        return grpc.ssl_channel_credentials(root_certificates=root, certificate_chain=c.read(),
                                            private_key=k.read())


class RouterClient:
    """A channel to a router, or to several replicas (`target` a list of ``IP:port``, or a
    list of one ``host:port`` whose name resolves to every replica: load spread over them,
    and a stream that fails before its first response retried on another); use
    ``async with`` (or call `close`). `api_key` is sent as
    ``authorization: Bearer <key>`` metadata, for a router started with API keys.
    `credentials` (`tls_credentials`) make the channel TLS, for a router started with
    ``--tls-*``; `server_name` is the name its certificate must carry when that is not the
    address dialled."""

    def __init__(self, target: str | Sequence[str], *, channel: grpc.aio.Channel | None = None,
                 timeout_s: float | None = 600.0, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None):
        # Several replicas on a channel of ours: round robin, gRPC's retry, and a stream that
        # ended UNAVAILABLE before its first response reached the caller sent again (see
        # _REPLICAS_SERVICE_CONFIG for why gRPC's own retry does not cover every such stream).
        replicas = channel is None and not isinstance(target, str)
        if channel is None:
            options: list[tuple[str, str | int]] = []
            if server_name is not None:
                options.append(("grpc.ssl_target_name_override", server_name))
            if replicas:
                options += [("grpc.service_config", _REPLICAS_SERVICE_CONFIG),
                            ("grpc.enable_retries", 1)]
            address = target if isinstance(target, str) else replicas_target(target)
            channel = (grpc.aio.insecure_channel(address, options=options or None)
                       if credentials is None
                       else grpc.aio.secure_channel(address, credentials, options=options))
        self._channel = channel
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._attempts = _STREAM_ATTEMPTS if replicas else 1

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, *, text: str | None = None, token_ids: Sequence[int] | None = None,
                       messages: Iterable[tuple[str, str]] | None = None,
                       sampling: Sampling | None = None, request_id: str = "",
                       latency: LatencyClass = "standard") -> AsyncIterator[Chunk]:
        """Stream one generation; exactly one of `text`, `token_ids`, `messages` (chat turns
        as ``(role, content)``). Leaving the loop early cancels the request."""
        inputs = [x is not None for x in (text, token_ids, messages)]
        if sum(inputs) != 1:
            raise ValueError("pass exactly one of text, token_ids, messages")
        req = router_pb2.GenerateRequest(request_id=request_id,
                                         sampling=(sampling or Sampling()).to_proto(),
                                         latency_class=_LATENCY[latency])
        if text is not None:
            req.text = text
        elif token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        else:
            assert messages is not None
            req.chat.messages.extend(router_pb2.ChatMessage(role=r, content=c)
                                     for r, c in messages)
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout_s is None else loop.time() + self._timeout_s
        for attempt in range(1, self._attempts + 1):
            timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
            call = self._stub.Generate(req, timeout=timeout, metadata=self._metadata)
            received = False
            try:
                async for resp in call:
                    received = True
                    yield _chunk(resp)
                return
            except grpc.aio.AioRpcError as exc:
                if (received or exc.code() != grpc.StatusCode.UNAVAILABLE
                        or attempt == self._attempts
                        or (deadline is not None and deadline - loop.time() <= _BACKOFF_S)):
                    raise RouterError.from_rpc(exc) from exc
            finally:
                call.cancel()
            await asyncio.sleep(random.uniform(0.0, _BACKOFF_S * attempt))

    async def complete(self, **kwargs: object) -> Completion:
        """`generate` collected into one result (same arguments)."""
        ids: list[int] = []
        parts: list[str] = []
        last: Chunk | None = None
        async for chunk in self.generate(**kwargs):  # type: ignore[arg-type]
            ids.extend(chunk.token_ids)
            parts.append(chunk.text)
            last = chunk
        if last is None:
            raise RouterError("UNKNOWN", "", "the router closed the stream without a response")
        return Completion(request_id=last.request_id, token_ids=tuple(ids), text="".join(parts),
                          finish_reason=last.finish_reason, usage=last.usage, route=last.route)

    async def abort(self, request_id: str) -> bool:
        """Cancel a running request by id; False when it is unknown or already finished.
        With several replicas the call reaches one of them, which knows only its own requests:
        there, cancel a stream by leaving its `generate` loop."""
        try:
            resp = await self._stub.Abort(common_pb2.AbortRequest(request_id=request_id),
                                          timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise RouterError.from_rpc(exc) from exc
        return bool(resp.found)
