"""gRPC side of the error mapping: exceptions -> status + trailers on the server, and back.

Both directions read `pdserve.errors` (the code -> class registry and the kind of each
error), the same table the HTTP gateway maps from, so an error reads the same on both.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeAlias

import grpc

from pdserve.errors import (
    ErrorCode,
    ErrorKind,
    InvalidRequestError,
    PdserveError,
    code_of,
    kind_of,
    rebuild,
)
from pdserve.rpc.metadata import (
    REQUEST_ID_KEY,
    invalid_request_id,
    metadata_value,
    request_id_from_context,
)
from pdserve.types import MAX_REQUEST_ID_LEN

log = logging.getLogger(__name__)

# A server interceptor's `intercept_service` arguments and result, as grpc.aio passes them.
MethodHandler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[MethodHandler | None]]"

ERROR_CODE_KEY = "pdserve-error-code"  # trailing metadata: PdserveError.code
ERROR_PARAM_KEY = "pdserve-error-param"  # trailing metadata: PdserveError.param, when set
RETRY_AFTER_KEY = "retry-after"  # trailing metadata: seconds, on an admission refusal
MAX_ERROR_MESSAGE_CHARS = 1024  # status details may quote client input; trailers stay small
_KIND_BY_STATUS = {grpc.StatusCode[k.grpc_status_name]: k for k in ErrorKind}
# RESOURCE_EXHAUSTED is ours only with the `overloaded` code in the trailers (which rebuilds
# OverloadedError); without it, grpc itself refused (a message over the size limit).
_KIND_BY_STATUS[grpc.StatusCode.RESOURCE_EXHAUSTED] = ErrorKind.UNAVAILABLE


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """(status, stable error code, param) that `exc` is reported as."""
    param = exc.param if isinstance(exc, PdserveError) else None
    return grpc.StatusCode[kind_of(exc).grpc_status_name], code_of(exc), param


def _error_metadata(exc: BaseException, request_id: str | None) -> tuple[tuple[str, str], ...]:
    _, code, param = status_for(exc)
    metadata = [(ERROR_CODE_KEY, code)]
    if param:
        metadata.append((ERROR_PARAM_KEY, param))
    if (retry_after := getattr(exc, "retry_after_s", None)) is not None:
        metadata.append((RETRY_AFTER_KEY, str(retry_after)))
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
    an `x-request-id` that breaks the request id rule of `pdserve.types.check_request_id`
    (code `invalid_request_id`; it is then neither logged nor echoed).
    """

    def __init__(self) -> None:
        # method -> (the handler grpc found, its wrapper): a method's handler is the same
        # object call after call, so its wrapper is built once, not per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any],
                                       grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Continuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> MethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        request_id = metadata_value(handler_call_details.invocation_metadata, REQUEST_ID_KEY)
        method = handler_call_details.method
        if request_id is not None and invalid_request_id(request_id):
            return _wrap(handler, method, _raiser(InvalidRequestError(
                f"{REQUEST_ID_KEY} metadata must be 1-{MAX_REQUEST_ID_LEN} printable ASCII "
                "characters", code=ErrorCode.INVALID_REQUEST_ID, param=REQUEST_ID_KEY)))
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def _wrap(handler: grpc.RpcMethodHandler[Any, Any], method: str,
          refusal: Callable[..., Any] | None = None) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with its exceptions mapped (`refusal`: the behavior instead of its own)."""
    def behavior(kind: Callable[..., Any]) -> Callable[..., Any]:
        return kind if refusal is None else refusal

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            _wrap_unary(behavior(handler.unary_unary), method),
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream(behavior(handler.unary_stream), method),
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            _wrap_unary(_checking(behavior(handler.stream_unary)), method),
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
    assert handler.stream_stream is not None  # a handler is one of the four kinds
    return grpc.stream_stream_rpc_method_handler(
        _wrap_stream(_checking(behavior(handler.stream_stream)), method),
        request_deserializer=_lenient(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


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


async def _decoded(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream whose every message parsed (else InvalidRequestError, there)."""
    async for request in requests:
        _check_decoded(request)
        yield request


def _checking(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """A stream-request handler that reads only messages that parsed (`_decoded`)."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for message in behavior(_decoded(requests), context):
                yield message
        return stream

    def call(requests: AsyncIterator[Any], context: Any) -> Any:
        return behavior(_decoded(requests), context)
    return call


def _check_decoded(request: Any) -> None:
    if isinstance(request, _Undecodable):
        raise InvalidRequestError(f"the request message does not parse: {request.error}",
                                  code=ErrorCode.INVALID_MESSAGE)


def reported(exc: Exception, method: str, request_id: str | None
             ) -> tuple[grpc.StatusCode, str, str, str | None]:
    """(status, message, code, param) a handler's failure is reported as, logged here: a
    PdserveError (or TimeoutError) keeps its message, clipped; anything else is an internal
    error, logged with its traceback. A multiplexed call (DecodeWorker.Session) reports each
    request's failure with these in a message instead of the call's status."""
    status, code, param = status_for(exc)
    if isinstance(exc, PdserveError | TimeoutError | NotImplementedError):
        message = _clip(str(exc) or code)
        log.info("%s failed: %s (%s, request_id=%s)", method, message, code, request_id)
    else:
        message = _clip(f"internal error: {type(exc).__name__}: {exc}")
        log.exception("%s failed unexpectedly (request_id=%s)", method, request_id)
    return status, message, code, param


def refusal(exc: Exception, method: str, request_id: str | None = None
            ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """What a call that failed with `exc` ends with: its status, message and trailers, as
    `ErrorInterceptor` reports them (the router's compiled data plane ends calls with it)."""
    status, message, _, _ = reported(exc, method, request_id)
    return status, message, _error_metadata(exc, request_id)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    # The caller's request id, read only now: a wrapper serves every call of its method.
    # A call with an invalid one never gets here with it (its handler only refuses it).
    request_id = request_id_from_context(context)
    status, message, _, _ = reported(exc, method, request_id)
    await context.abort(status, message, trailing_metadata=_error_metadata(exc, request_id))


def _clip(message: str) -> str:
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    return message[:MAX_ERROR_MESSAGE_CHARS] + f"... ({len(message)} characters)"


def _wrap_unary(behavior: Callable[..., Any], method: str
                ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, method)

    return unary


def _wrap_stream(
    behavior: Callable[..., Any], method: str
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any] | Awaitable[None]]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                _check_decoded(request)
                async for message in behavior(request, context):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort(context, exc, method)

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
            await _abort(context, exc, method)

    return write_stream


def error_from_rpc(exc: grpc.RpcError) -> PdserveError | TimeoutError:
    """The `pdserve.errors` exception a failed call stands for; raise it `from exc`.

    The class comes from the `pdserve-error-code` trailer when the registry names it, else
    from the status (UNAVAILABLE without a trailer, e.g. a dead worker, becomes CapacityError
    with code "worker_unavailable"). DEADLINE_EXCEEDED becomes TimeoutError.
    """
    status = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (exc.details() if callable(getattr(exc, "details", None)) else None) or str(status)
    # grpc's stubs type the trailers as `_Metadatum` records; they are (key, value) pairs.
    trailers: Iterable[tuple[str, Any]] = (
        exc.trailing_metadata()  # type: ignore[assignment]
        if callable(getattr(exc, "trailing_metadata", None)) else ())
    return error_from_status(status, message, metadata_value(trailers, ERROR_CODE_KEY),
                             metadata_value(trailers, ERROR_PARAM_KEY))


_STATUS_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}


def error_from_status(status: grpc.StatusCode | int, message: str, code: str | None,
                      param: str | None = None) -> PdserveError | TimeoutError:
    """`error_from_rpc` for a failure received as its parts (`reported`'s, in a message);
    `status` may be its number (an unknown one is UNKNOWN)."""
    if isinstance(status, int):
        status = _STATUS_BY_NUMBER.get(status, grpc.StatusCode.UNKNOWN)
    if code is None and status == grpc.StatusCode.UNAVAILABLE:
        code = ErrorCode.WORKER_UNAVAILABLE
    return rebuild(_KIND_BY_STATUS.get(status, ErrorKind.INTERNAL), code, message, param)


@contextlib.contextmanager
def translate_rpc_errors() -> Iterator[None]:
    """`with translate_rpc_errors(): async for r in stub.Generate(...)` raises engine errors."""
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from exc
