"""gRPC plumbing shared by every pdserve service and client.

The one place where `engine.types` meets the generated `pdserve.v1` stubs:

- errors: `ErrorInterceptor` turns `engine.types` exceptions raised by a servicer into gRPC
  statuses carrying the stable error code in trailing metadata, and refuses what no handler
  should see (an undecodable message, an invalid `x-request-id`) with INVALID_ARGUMENT;
  `error_from_rpc` and `translate_rpc_errors` turn them back into the same exception types on
  the client;
- health: `add_health` plus `set_serving` / `set_not_serving` (grpc.health.v1);
- conversion between domain dataclasses and proto messages (`sampling_to_proto`, ...);
- `x-request-id` metadata, and channel/server options (keepalive, 64 MB messages).

Servicers are thin adapters: proto -> domain (helpers here) -> domain call -> proto.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as _health_aio

from engine.types import (
    MAX_REQUEST_ID_LEN,
    CapacityError,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    KVLayout,
    KVTransferError,
    LatencyClass,
    PdserveError,
    RequestAbortedError,
    SamplingParams,
    StageTimings,
    TokenEvent,
    TokenLogprob,
    check_request_id,
    fit_max_tokens,
)
from pdserve.v1 import common_pb2, decode_pb2

log = logging.getLogger(__name__)

ERROR_CODE_KEY = "pdserve-error-code"  # trailing metadata: PdserveError.code
ERROR_PARAM_KEY = "pdserve-error-param"  # trailing metadata: PdserveError.param, when set
REQUEST_ID_KEY = "x-request-id"  # invocation metadata; echoed in error trailers
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_ERROR_MESSAGE_CHARS = 1024  # status details may quote client input; trailers stay small

# --------------------------------------------------------------------------- errors

# Most specific first: the first matching class decides the status.
_STATUS_BY_ERROR: tuple[tuple[type[PdserveError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),  # PromptTooLongError included
    (CapacityError, grpc.StatusCode.UNAVAILABLE),  # busy, not broken: retry elsewhere or later
    (RequestAbortedError, grpc.StatusCode.CANCELLED),
    (KVTransferError, grpc.StatusCode.ABORTED),  # retry at a higher level (new allocation)
    (PdserveError, grpc.StatusCode.INTERNAL),
)
# Client side, when the trailing code names no known class: the status picks the class.
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[PdserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.UNAVAILABLE: CapacityError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.CANCELLED: RequestAbortedError,
    grpc.StatusCode.ABORTED: KVTransferError,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """(status, stable error code, param) that `exc` is reported as."""
    if isinstance(exc, PdserveError):
        status = next(s for cls, s in _STATUS_BY_ERROR if isinstance(exc, cls))
        return status, exc.code, exc.param
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError since 3.11
        return grpc.StatusCode.DEADLINE_EXCEEDED, "timeout", None
    if isinstance(exc, NotImplementedError):  # what generated servicer base methods raise
        return grpc.StatusCode.UNIMPLEMENTED, "unimplemented", None
    return grpc.StatusCode.INTERNAL, PdserveError.code, None


def _error_metadata(exc: BaseException, request_id: str | None) -> tuple[tuple[str, str], ...]:
    _, code, param = status_for(exc)
    metadata = [(ERROR_CODE_KEY, code)]
    if param:
        metadata.append((ERROR_PARAM_KEY, param))
    if request_id:
        metadata.append((REQUEST_ID_KEY, request_id))
    return tuple(metadata)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to a gRPC status with `pdserve-error-code` trailers.

    PdserveError subclasses and TimeoutError keep their message (clipped to
    MAX_ERROR_MESSAGE_CHARS); any other exception is logged and reported as INTERNAL. A
    handler's own `context.abort(...)` and client cancellation pass through untouched. Works for
    every handler kind, async generators included (an error after some streamed messages ends
    the stream with the mapped status).

    Client mistakes that no handler gets to see are INVALID_ARGUMENT too: a request message
    that does not parse (e.g. a string field that is not UTF-8; code `invalid_message`), and
    an `x-request-id` that breaks the request id rule of `engine.types.check_request_id`
    (code `invalid_request_id`; it is then neither logged nor echoed).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        request_id = _metadata_value(handler_call_details.invocation_metadata, REQUEST_ID_KEY)
        method = handler_call_details.method
        refusal: InvalidRequestError | None = None
        if request_id is not None and _invalid_request_id(request_id):
            request_id = None
            refusal = InvalidRequestError(
                f"{REQUEST_ID_KEY} metadata must be 1-{MAX_REQUEST_ID_LEN} printable ASCII "
                "characters", code="invalid_request_id", param=REQUEST_ID_KEY)

        def behavior(kind: Callable[..., Any]) -> Callable[..., Any]:
            return kind if refusal is None else _raiser(refusal)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(behavior(handler.unary_unary), method, request_id),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(behavior(handler.unary_stream), method, request_id),
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(behavior(handler.stream_unary), method, request_id),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(behavior(handler.stream_stream), method, request_id),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _invalid_request_id(request_id: str) -> bool:
    try:
        check_request_id(request_id)
    except InvalidRequestError:
        return True
    return False


def _raiser(exc: Exception) -> Callable[..., Any]:
    def fail(request: Any, context: grpc.aio.ServicerContext) -> None:
        raise exc

    return fail


class _Undecodable:
    """What a request message that failed to parse becomes; the wrapped handler refuses it."""

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that never raises: grpc would report its exception as a server fault."""
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a custom codec raises
            return _Undecodable(exc)

    return parse


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidRequestError(f"the request message does not parse: {request.error}",
                                  code="invalid_message")


async def _abort(
    context: grpc.aio.ServicerContext, exc: Exception, method: str, request_id: str | None
) -> None:
    status, code, _ = status_for(exc)
    if isinstance(exc, PdserveError | TimeoutError | NotImplementedError):
        message = _clip(str(exc) or code)
        log.info("%s failed: %s (%s, request_id=%s)", method, message, code, request_id)
    else:
        message = _clip(f"internal error: {type(exc).__name__}: {exc}")
        log.exception("%s failed unexpectedly (request_id=%s)", method, request_id)
    await context.abort(status, message, trailing_metadata=_error_metadata(exc, request_id))


def _clip(message: str) -> str:
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    return message[:MAX_ERROR_MESSAGE_CHARS] + f"... ({len(message)} characters)"


def _wrap_unary(behavior: Callable[..., Any], method: str, request_id: str | None):
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method, request_id)

    return unary


def _wrap_stream(behavior: Callable[..., Any], method: str, request_id: str | None):
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                _check_decoded(request)
                async for message in behavior(request, context):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, method, request_id)

        return stream

    async def write_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
        # A coroutine that writes with context.write(), or a plain function returning an iterable.
        try:
            _check_decoded(request)
            result = behavior(request, context)
            if inspect.isawaitable(result):
                await result
            elif result is not None:
                for message in result:
                    await context.write(message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method, request_id)

    return write_stream


def error_from_rpc(exc: grpc.RpcError) -> PdserveError | TimeoutError:
    """The engine.types error a failed call stands for; raise it `from exc`.

    The class comes from the `pdserve-error-code` trailer when it names one, else from the
    status (UNAVAILABLE without a trailer, e.g. a dead worker, becomes CapacityError with code
    "worker_unavailable"). DEADLINE_EXCEEDED becomes TimeoutError.
    """
    status = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (exc.details() if callable(getattr(exc, "details", None)) else None) or str(status)
    trailers = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else ()
    code = _metadata_value(trailers, ERROR_CODE_KEY)
    param = _metadata_value(trailers, ERROR_PARAM_KEY)
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(message)
    cls = _error_classes().get(code or "") or _ERROR_BY_STATUS.get(status, PdserveError)
    if code is None:
        code = "worker_unavailable" if status == grpc.StatusCode.UNAVAILABLE else cls.code
    return cls(message, code=code, param=param)


@contextlib.contextmanager
def translate_rpc_errors() -> Iterator[None]:
    """`with translate_rpc_errors(): async for r in stub.Generate(...)` raises engine errors."""
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from exc


def _error_classes() -> dict[str, type[PdserveError]]:
    """Every PdserveError subclass by its default code."""
    found: dict[str, type[PdserveError]] = {}
    pending: list[type[PdserveError]] = [PdserveError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


# --------------------------------------------------------------------------- metadata


def _metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def request_id_metadata(
    request_id: str, metadata: Iterable[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `x-request-id` (plus any other pairs given)."""
    return (*((k, v) for k, v in metadata if k != REQUEST_ID_KEY), (REQUEST_ID_KEY, request_id))


def request_id_from_context(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's `x-request-id`, if it sent a valid one (servers built with `new_server`
    refuse calls carrying an invalid one)."""
    rid = _metadata_value(context.invocation_metadata(), REQUEST_ID_KEY)
    return None if rid is None or _invalid_request_id(rid) else rid


# --------------------------------------------------------------------------- health

HealthServicer = _health_aio.HealthServicer  # the asyncio grpc.health.v1 servicer


async def add_health(server: grpc.aio.Server, *services: str) -> HealthServicer:
    """Register grpc.health.v1 on `server`; "" (overall) and `services` start NOT_SERVING.

    Call `set_serving` once the service can take requests (model loaded, registered), and
    `health.enter_graceful_shutdown()` on SIGTERM before `server.stop(grace)`.
    """
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await set_not_serving(health, *services)
    return health


async def set_serving(health: HealthServicer, *services: str) -> None:
    """Mark "" (overall) and `services` SERVING."""
    for service in ("", *services):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)


async def set_not_serving(health: HealthServicer, *services: str) -> None:
    """Mark "" (overall) and `services` NOT_SERVING (draining, or not ready yet)."""
    for service in ("", *services):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)


# --------------------------------------------------------------------------- channels


def channel_options(
    *, max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_ms: int = 30_000
) -> list[tuple[str, int]]:
    """Client channel options: big messages, keepalive pings that detect dead peers."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(
    *, max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_ms: int = 30_000
) -> list[tuple[str, int]]:
    """Server options matching `channel_options`: accepts its pings instead of GOAWAY-ing."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def insecure_channel(target: str, **options: int) -> grpc.aio.Channel:
    """A plaintext channel with `channel_options(**options)`; the caller owns it (`async with`)."""
    return grpc.aio.insecure_channel(target, options=channel_options(**options))


def new_server(*interceptors: grpc.aio.ServerInterceptor, **options: int) -> grpc.aio.Server:
    """A grpc.aio server with `ErrorInterceptor` first and `server_options(**options)`."""
    return grpc.aio.server(
        interceptors=[ErrorInterceptor(), *interceptors], options=server_options(**options)
    )


# --------------------------------------------------------------------------- conversion

_LATENCY_TO_PROTO = {
    LatencyClass.INTERACTIVE: common_pb2.LATENCY_CLASS_INTERACTIVE,
    LatencyClass.STANDARD: common_pb2.LATENCY_CLASS_STANDARD,
    LatencyClass.BATCH: common_pb2.LATENCY_CLASS_BATCH,
}
_LATENCY_FROM_PROTO = {
    **{v: k for k, v in _LATENCY_TO_PROTO.items()},
    common_pb2.LATENCY_CLASS_UNSPECIFIED: LatencyClass.STANDARD,
}
_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_INT64 = (-(2**63), 2**63 - 1)


def latency_to_proto(latency: LatencyClass) -> common_pb2.LatencyClass.ValueType:
    return _LATENCY_TO_PROTO[latency]


def latency_from_proto(value: int) -> LatencyClass:
    """UNSPECIFIED means STANDARD; a value this build does not know is an invalid request."""
    try:
        return _LATENCY_FROM_PROTO[value]
    except KeyError:
        raise InvalidRequestError(
            f"unknown latency class {value}", code="invalid_latency_class", param="latency_class"
        ) from None


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason.ValueType:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None while unfinished (UNSPECIFIED); an unknown value reads as ERROR."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    if params.seed is not None and not _INT64[0] <= params.seed <= _INT64[1]:
        raise InvalidRequestError(
            "seed must fit in a signed 64-bit integer", code="invalid_sampling_params", param="seed"
        )
    return common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )


def sampling_from_proto(msg: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset fields take the domain defaults; raises InvalidRequestError on invalid values."""
    if msg is None:
        return SamplingParams()
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else defaults.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
    )


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=msg.token_id,
        logprob=msg.logprob,
        top=tuple((t.token_id, t.logprob) for t in msg.top),
    )


def timings_to_proto(t: StageTimings) -> common_pb2.StageTimings:
    """Stage boundaries (monotonic seconds) to stage durations (ms); unreached stages are 0.

    `t.extra` is copied verbatim: by convention its values are already durations in ms.
    """
    transfer_end = t.kv_transferred or t.prefill_done
    return common_pb2.StageTimings(
        queued_ms=_span_ms(t.arrived, t.scheduled),
        prefill_compute_ms=_span_ms(t.scheduled, t.prefill_done),
        kv_transfer_ms=_span_ms(t.prefill_done, t.kv_transferred),
        decode_admission_ms=_span_ms(transfer_end, t.admitted),
        first_token_ms=_span_ms(t.arrived, t.first_token),
        total_ms=_span_ms(t.arrived, t.finished),
        extra=dict(t.extra),
    )


def _span_ms(start: float, end: float) -> float:
    return (end - start) * 1000.0 if start > 0.0 and end >= start else 0.0


def kv_layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_blocks=layout.num_blocks,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        model_id=layout.model_id,
    )


def kv_layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        num_blocks=msg.num_blocks,
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        model_id=msg.model_id,
    )


def request_fields(request: GenerateRequest) -> dict[str, Any]:
    """Fields shared by DecodeGenerateRequest, AllocateRequest and PrefillRequest:
    `decode_pb2.DecodeGenerateRequest(**request_fields(req), return_timings=True)`."""
    return {
        "request_id": request.request_id,
        "prompt_token_ids": request.prompt_token_ids,
        "sampling": sampling_to_proto(request.sampling),
        "latency_class": latency_to_proto(request.latency_class),
    }


def request_from_proto(msg: Any, max_model_len: int | None = None) -> GenerateRequest:
    """GenerateRequest from any message with request_id, prompt_token_ids, sampling and
    latency_class; raises InvalidRequestError on invalid values, and PromptTooLongError when
    the prompt plus max_tokens exceed `max_model_len` (when given)."""
    req = GenerateRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling if msg.HasField("sampling") else None),
        latency_class=latency_from_proto(msg.latency_class),
    )
    if max_model_len is not None:
        fit_max_tokens(len(req.prompt_token_ids), req.sampling.max_tokens, max_model_len,
                       default=req.sampling.max_tokens)
    return req


def token_event_to_chunk(
    event: TokenEvent, timings: StageTimings | None = None
) -> decode_pb2.TokenChunk:
    """A TokenChunk for `event`; pass `timings` on the last event when they were requested."""
    return decode_pb2.TokenChunk(
        request_id=event.request_id,
        token_id=event.token_id,
        text=event.text,
        logprob=None if event.logprob is None else logprob_to_proto(event.logprob),
        finish_reason=finish_reason_to_proto(event.finish_reason),
        error=event.error or "",
        num_prompt_tokens=event.num_prompt_tokens,
        num_cached_tokens=event.num_cached_tokens,
        num_output_tokens=event.num_output_tokens,
        timings=None if timings is None else timings_to_proto(timings),
    )


def token_event_from_chunk(chunk: decode_pb2.TokenChunk) -> TokenEvent:
    return TokenEvent(
        request_id=chunk.request_id,
        token_id=chunk.token_id if chunk.HasField("token_id") else None,
        text=chunk.text,
        logprob=logprob_from_proto(chunk.logprob) if chunk.HasField("logprob") else None,
        finish_reason=finish_reason_from_proto(chunk.finish_reason),
        error=chunk.error or None,
        num_prompt_tokens=chunk.num_prompt_tokens,
        num_cached_tokens=chunk.num_cached_tokens,
        num_output_tokens=chunk.num_output_tokens,
    )


def timings_ms(msg: common_pb2.StageTimings) -> dict[str, float]:
    """Every duration of a StageTimings message by name (ms), for logs and metrics."""
    return {
        "queued_ms": msg.queued_ms,
        "prefill_compute_ms": msg.prefill_compute_ms,
        "kv_transfer_ms": msg.kv_transfer_ms,
        "decode_admission_ms": msg.decode_admission_ms,
        "first_token_ms": msg.first_token_ms,
        "total_ms": msg.total_ms,
        **msg.extra,
    }
