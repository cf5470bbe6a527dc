"""The generated v1 stubs and pdserve.rpc (errors, transport, conversion), against a real
grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.control.load import WorkerLoad
from pdserve.errors import (
    CapacityError,
    InvalidRequestError,
    KVTransferError,
    ModelLoadError,
    PdserveError,
    PromptTooLongError,
    RequestAbortedError,
)
from pdserve.kv_layout import KVLayout
from pdserve.rpc import convert, metadata, transport
from pdserve.rpc import errors as rpc_errors
from pdserve.rpc.transport import HealthServicer
from pdserve.types import (
    FinishReason,
    GenerateRequest,
    LatencyClass,
    SamplingParams,
    StageTimings,
    TokenEvent,
    TokenLogprob,
)
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

ROOT = Path(__file__).resolve().parents[1]
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name

# name -> (exception raised by the servicer, expected status, expected trailing code)
ERRORS: dict[str, tuple[BaseException, grpc.StatusCode, str]] = {
    "invalid": (
        InvalidRequestError("bad prompt", param="prompt"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_request",
    ),
    "too_long": (
        PromptTooLongError("prompt has 9000 tokens, limit 4096"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "context_length_exceeded",
    ),
    "custom_code": (
        InvalidRequestError("top_p out of range", code="invalid_sampling_params", param="top_p"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "invalid_sampling_params",
    ),
    "capacity": (CapacityError("no free blocks"), grpc.StatusCode.UNAVAILABLE, "no_capacity"),
    "aborted": (RequestAbortedError("aborted by caller"), grpc.StatusCode.CANCELLED, "aborted"),
    "kv": (KVTransferError("peer gone"), grpc.StatusCode.ABORTED, "kv_transfer_error"),
    "model": (ModelLoadError("no weights"), grpc.StatusCode.INTERNAL, "model_load_error"),
    # asyncio.TimeoutError is TimeoutError since Python 3.11
    "timeout": (TimeoutError("waited 5 s for KV"), grpc.StatusCode.DEADLINE_EXCEEDED, "timeout"),
    "bug": (ValueError("oops"), grpc.StatusCode.INTERNAL, "internal_error"),
}


class EchoRouter(router_pb2_grpc.RouterServicer):
    """Streams the prompt back one character per response; "raise:NAME" fails after 2."""

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        sampling = convert.sampling_from_proto(request.sampling)  # validates
        request_id = request.request_id or metadata.request_id_from_context(context) or "gen"
        text = request.text
        error = ERRORS[text.removeprefix("raise:")][0] if text.startswith("raise:") else None
        text = text[:2] if error else text[: sampling.max_tokens]
        for i, ch in enumerate(text):
            yield router_pb2.GenerateResponse(
                request_id=request_id,
                token_ids=[ord(ch)],
                text=ch,
                usage=router_pb2.Usage(prompt_tokens=len(request.text), completion_tokens=i + 1),
                route=common_pb2.PREFILL_ROUTE_LOCAL,
            )
        if error is not None:
            raise error
        yield router_pb2.GenerateResponse(
            request_id=request_id,
            finish_reason=convert.finish_reason_to_proto(FinishReason.STOP),
            usage=router_pb2.Usage(prompt_tokens=len(request.text), completion_tokens=len(text)),
            timings=(
                convert.stage_timings_to_proto(StageTimings(first_token_ms=250.0, total_ms=300.0))
                if request.return_timings
                else None
            ),
        )

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        if request.request_id in ERRORS:
            raise ERRORS[request.request_id][0]
        if request.request_id == "self_abort":  # a handler's own abort passes through
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")
        return common_pb2.AbortResponse(found=True)


class WritingDecode(decode_pb2_grpc.DecodeWorkerServicer):
    """Streams with context.write() instead of yielding; Stats is left unimplemented."""

    async def Generate(
        self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        req = convert.request_from_proto(request.input)
        for i, token in enumerate(req.prompt_token_ids, start=1):
            await context.write(
                convert.token_event_to_chunk(
                    TokenEvent(req.request_id, token, text=str(token), num_output_tokens=i)
                )
            )
        raise CapacityError("evicted")


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, HealthServicer]]:
    """(address, health servicer) of a real server on an ephemeral loopback port."""
    srv = transport.new_server()
    router_pb2_grpc.add_RouterServicer_to_server(EchoRouter(), srv)
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(WritingDecode(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    health = await transport.add_health(srv, ROUTER_SERVICE)
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", health
    finally:
        await srv.stop(None)


@pytest.fixture
async def channel(server: tuple[str, HealthServicer]) -> AsyncIterator[grpc.aio.Channel]:
    async with transport.insecure_channel(server[0]) as ch:
        yield ch


def _trailing_code(exc: grpc.aio.AioRpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(rpc_errors.ERROR_CODE_KEY)


# --------------------------------------------------------------------------- stubs


def test_stubs_define_the_services() -> None:
    def methods(module: object, service: str) -> set[str]:
        return set(module.DESCRIPTOR.services_by_name[service].methods_by_name)  # type: ignore[attr-defined]

    assert methods(router_pb2, "Router") == {"Generate", "Abort"}
    assert methods(decode_pb2, "DecodeWorker") == {
        "Generate",
        "Session",  # many Generate requests on one call (the router's way)
        "AllocateAndGenerate",
        "AllocateRemote",  # deprecated: served one more release, not used by the router
        "GenerateRemote",  # deprecated with AllocateRemote
        "Abort",
        "CachedPrefix",
        "Stats",
    }
    assert methods(prefill_pb2, "PrefillWorker") == {"Prefill", "Stats"}
    for stub in (
        router_pb2_grpc.RouterStub,
        decode_pb2_grpc.DecodeWorkerStub,
        prefill_pb2_grpc.PrefillWorkerStub,
    ):
        assert callable(stub)
    assert router_pb2.DESCRIPTOR.package == "pdserve.v1"
    assert router_pb2.DESCRIPTOR.dependencies[0].name == "pdserve/v1/common.proto"


def test_every_proto_field_is_commented() -> None:
    for proto in sorted((ROOT / "protos" / "pdserve" / "v1").glob("*.proto")):
        for n, line in enumerate(proto.read_text().splitlines(), start=1):
            code = line.split("//")[0].strip()
            is_field = (
                code.endswith(";") and "=" in code and not code.startswith(("syntax", "option"))
            )
            if is_field and "//" not in line:
                pytest.fail(f"{proto.name}:{n} has no comment: {line.strip()}")


# --------------------------------------------------------------------------- server


async def test_generate_streams_tokens_with_request_id(channel: grpc.aio.Channel) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    request = router_pb2.GenerateRequest(text="hello", return_timings=True)
    call = stub.Generate(request, metadata=metadata.request_id_metadata("rid-7"))
    responses = [r async for r in call]
    assert "".join(r.text for r in responses) == "hello"
    assert {r.request_id for r in responses} == {"rid-7"}
    assert [convert.finish_reason_from_proto(r.finish_reason) for r in responses] == [
        None
    ] * 5 + [FinishReason.STOP]
    assert responses[-1].usage.completion_tokens == 5
    assert responses[-1].timings.first_token_ms == pytest.approx(250.0)
    assert not responses[0].HasField("timings")
    assert await call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("name", list(ERRORS))
async def test_unary_errors_map_to_status_and_trailing_code(
    channel: grpc.aio.Channel, name: str
) -> None:
    exc, status, code = ERRORS[name]
    stub = router_pb2_grpc.RouterStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(
            common_pb2.AbortRequest(request_id=name),
            metadata=metadata.request_id_metadata("rid-err"),
        )
    assert info.value.code() == status
    assert _trailing_code(info.value) == code
    trailers = dict(info.value.trailing_metadata())
    assert trailers[metadata.REQUEST_ID_KEY] == "rid-err"
    if isinstance(exc, PdserveError):
        assert info.value.details() == exc.message
        assert trailers.get(rpc_errors.ERROR_PARAM_KEY) == exc.param

    translated = rpc_errors.error_from_rpc(info.value)
    if isinstance(exc, TimeoutError):
        assert type(translated) is TimeoutError
    elif isinstance(exc, PdserveError):
        assert type(translated) is type(exc)
        assert (translated.code, translated.message, translated.param) == (
            exc.code,
            exc.message,
            exc.param,
        )
    else:
        assert type(translated) is PdserveError
        assert "ValueError: oops" in translated.message


@pytest.mark.parametrize("name", ["invalid", "capacity", "kv", "timeout", "bug"])
async def test_stream_errors_after_some_tokens(channel: grpc.aio.Channel, name: str) -> None:
    _, status, code = ERRORS[name]
    stub = router_pb2_grpc.RouterStub(channel)
    received: list[str] = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stub.Generate(router_pb2.GenerateRequest(text=f"raise:{name}")):
            received.append(response.text)
    assert received == ["r", "a"]
    assert info.value.code() == status
    assert _trailing_code(info.value) == code


async def test_translate_rpc_errors_raises_domain_errors(channel: grpc.aio.Channel) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    bad_sampling = common_pb2.SamplingParams(top_p=0.0)  # explicitly set: invalid
    with pytest.raises(InvalidRequestError) as info, rpc_errors.translate_rpc_errors():
        async for _ in stub.Generate(router_pb2.GenerateRequest(text="x", sampling=bad_sampling)):
            pass
    assert info.value.code == "invalid_sampling_params"
    assert info.value.param == "top_p"
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)

    with pytest.raises(CapacityError), rpc_errors.translate_rpc_errors():
        async for _ in stub.Generate(router_pb2.GenerateRequest(text="raise:capacity")):
            pass


async def test_handlers_own_abort_passes_through(channel: grpc.aio.Channel) -> None:
    stub = router_pb2_grpc.RouterStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(common_pb2.AbortRequest(request_id="self_abort"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such request"
    assert _trailing_code(info.value) is None
    assert (await stub.Abort(common_pb2.AbortRequest(request_id="ok"))).found


async def test_write_style_stream_and_unimplemented(channel: grpc.aio.Channel) -> None:
    stub = decode_pb2_grpc.DecodeWorkerStub(channel)
    request = decode_pb2.DecodeGenerateRequest(
        input=convert.input_to_proto(GenerateRequest("d1", (5, 6, 7)))
    )
    events: list[TokenEvent] = []
    with pytest.raises(CapacityError, match="evicted"), rpc_errors.translate_rpc_errors():
        async for chunk in stub.Generate(request):
            events.append(convert.token_event_from_chunk(chunk))
    assert [e.token_id for e in events] == [5, 6, 7]
    assert events[-1].num_output_tokens == 3

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(common_pb2.StatsRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_dead_server_reads_as_capacity_error() -> None:
    async with transport.insecure_channel("127.0.0.1:1") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        with pytest.raises(CapacityError) as info, rpc_errors.translate_rpc_errors():
            await stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)
    assert info.value.code == "worker_unavailable"


async def test_health_serving_and_not_serving(
    server: tuple[str, HealthServicer], channel: grpc.aio.Channel
) -> None:
    health = server[1]
    stub = health_pb2_grpc.HealthStub(channel)

    async def status(service: str = "") -> int:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return response.status

    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    assert await status() == not_serving
    assert await status(ROUTER_SERVICE) == not_serving
    await transport.set_serving(health, ROUTER_SERVICE)
    assert await status() == serving
    assert await status(ROUTER_SERVICE) == serving
    await transport.set_not_serving(health, ROUTER_SERVICE)
    assert await status() == not_serving
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await status("no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_example_client_streams_text(server: tuple[str, HealthServicer]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "grpc_client.py"),
        "--router",
        server[0],
        "--timings",
        "hi there",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, stderr.decode()
    assert stdout.decode() == "hi there\n"
    assert "FINISH_REASON_STOP" in stderr.decode()
    assert "first_token_ms" in stderr.decode()


async def test_example_client_reports_error_code(server: tuple[str, HealthServicer]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "grpc_client.py"),
        "--router",
        server[0],
        "raise:too_long",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 1
    assert "error [context_length_exceeded]" in stderr.decode()


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=300,
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            seed=-(2**63),
            stop=("\n\n", "</s>"),
            stop_token_ids=(2, 32000),
            ignore_eos=True,
            logprobs=0,
        ),
        SamplingParams(seed=0, logprobs=20, temperature=100.0, top_p=1e-9),
    ],
)
def test_sampling_round_trip(params: SamplingParams) -> None:
    msg = convert.sampling_to_proto(params)
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert convert.sampling_from_proto(wire) == params


def test_sampling_defaults_and_validation() -> None:
    assert convert.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert convert.sampling_from_proto(None) == SamplingParams()
    with pytest.raises(InvalidRequestError) as info:
        convert.sampling_from_proto(common_pb2.SamplingParams(max_tokens=0))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        convert.sampling_from_proto(common_pb2.SamplingParams(logprobs=21))
    with pytest.raises(InvalidRequestError) as info:
        convert.sampling_to_proto(SamplingParams(seed=2**64))
    assert info.value.param == "seed"


def test_sampling_made_once_per_message_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal messages share one SamplingParams (frozen); an invalid message is refused every
    time, a long one is converted every time, and the store is bounded."""
    monkeypatch.setattr(convert, "_SAMPLING_MADE", {})
    monkeypatch.setattr(convert, "_SAMPLING_MADE_MAX", 3)
    first = convert.sampling_from_proto(common_pb2.SamplingParams(max_tokens=7, seed=3))
    again = convert.sampling_from_proto(common_pb2.SamplingParams.FromString(
        common_pb2.SamplingParams(max_tokens=7, seed=3).SerializeToString()))
    assert again is first and first == SamplingParams(max_tokens=7, seed=3)
    other = convert.sampling_from_proto(common_pb2.SamplingParams(max_tokens=7))
    assert other is not first and other.seed is None
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            convert.sampling_from_proto(common_pb2.SamplingParams(max_tokens=0))
    long = common_pb2.SamplingParams(stop=["x" * 300, "y" * 300])
    assert convert.sampling_from_proto(long) is not convert.sampling_from_proto(long)
    assert len(convert._SAMPLING_MADE) == 2
    for n in range(1, 5):
        convert.sampling_from_proto(common_pb2.SamplingParams(max_tokens=n))
    assert len(convert._SAMPLING_MADE) <= 3


def test_sampling_wire_is_the_message_serialized_once_per_instance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's sampling bytes: sampling_to_proto's, kept per instance (equal instances
    each get their own entry, a new instance is never served another's bytes), bounded, and
    an invalid one refused every time."""
    monkeypatch.setattr(convert, "_SAMPLING_WIRE", {})
    monkeypatch.setattr(convert, "_SAMPLING_MADE_MAX", 3)
    made = [SamplingParams(max_tokens=n, seed=n) for n in range(1, 6)]
    for params in [*made, *made]:
        assert convert.sampling_wire(params) == (
            convert.sampling_to_proto(params).SerializeToString())
        assert len(convert._SAMPLING_WIRE) <= 3
    first = convert.sampling_wire(made[0])
    assert convert.sampling_wire(made[0]) is first
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            convert.sampling_wire(SamplingParams(seed=2**64))
    msg = common_pb2.GenerateInput()
    request = GenerateRequest("r-1", (5, 6, 7), made[1])
    convert.fill_input(msg, request, prompt=False)
    assert msg.sampling == convert.sampling_to_proto(made[1]) and not msg.prompt_token_ids


def test_enum_round_trips() -> None:
    for latency in LatencyClass:
        assert convert.latency_from_proto(convert.latency_to_proto(latency)) == latency
    assert convert.latency_from_proto(common_pb2.LATENCY_CLASS_UNSPECIFIED) == (
        LatencyClass.STANDARD
    )
    with pytest.raises(InvalidRequestError):
        convert.latency_from_proto(99)
    for reason in [*FinishReason, None]:
        assert convert.finish_reason_from_proto(convert.finish_reason_to_proto(reason)) == (
            reason
        )


def test_token_event_and_logprob_round_trip() -> None:
    lp = TokenLogprob(token_id=11, logprob=-0.25, top=((11, -0.25), (12, -1.5)))
    assert convert.logprob_from_proto(convert.logprob_to_proto(lp)) == lp
    events = [
        TokenEvent("r", 11, text="he", logprob=lp, num_prompt_tokens=4, num_output_tokens=1),
        TokenEvent("r", 0, text="", num_cached_tokens=16),  # token id 0 is a real token
        TokenEvent("r", None, finish_reason=FinishReason.ERROR, error="device lost"),
        TokenEvent("r", 13, finish_reason=FinishReason.LENGTH, num_output_tokens=3),
    ]
    for event in events:
        chunk = convert.token_event_to_chunk(event)
        wire = decode_pb2.TokenChunk.FromString(chunk.SerializeToString())
        assert convert.token_event_from_chunk(wire) == event


def test_request_and_layout_round_trip() -> None:
    req = GenerateRequest(
        "r1", (1, 2, 3), SamplingParams(max_tokens=5, seed=1), LatencyClass.INTERACTIVE
    )
    # One GenerateInput message, carried by every worker rpc that starts generation.
    messages = [
        decode_pb2.DecodeGenerateRequest(input=convert.input_to_proto(req)),
        decode_pb2.AllocateRequest(input=convert.input_to_proto(req), lease_ms=5),
        prefill_pb2.PrefillRequest(
            input=convert.input_to_proto(req),
            destination=prefill_pb2.KVDestination(descriptor_id="d", block_ids=[4, 9]),
        ),
    ]
    for msg in messages:
        wire = type(msg).FromString(msg.SerializeToString())
        assert convert.request_from_proto(wire.input) == req
    with pytest.raises(InvalidRequestError):
        convert.request_from_proto(common_pb2.GenerateInput(request_id="r"))
    with pytest.raises(InvalidRequestError):  # no input at all
        convert.request_from_proto(decode_pb2.DecodeGenerateRequest().input)

    layout = KVLayout(1024, 28, 16, 8, 128, "bfloat16", "qwen2.5-0.5b")
    assert convert.kv_layout_from_proto(convert.kv_layout_to_proto(layout)) == layout


def test_pruned_fields_are_gone() -> None:
    """The first token has one channel (the KV notice) and timings one path (the router)."""
    fields = {
        decode_pb2.RemoteGenerateRequest: {"request_id", "transfer_id", "transfer_timeout_ms"},
        prefill_pb2.PrefillResponse: {
            "request_id", "timings", "bytes_transferred", "num_computed_tokens", "worker_id"},
        decode_pb2.DecodeGenerateRequest: {"input"},
    }
    for cls, names in fields.items():
        assert set(cls.DESCRIPTOR.fields_by_name) == names, cls.DESCRIPTOR.name
    assert "timings" not in decode_pb2.TokenChunk.DESCRIPTOR.fields_by_name


def test_stage_timings_round_trip() -> None:
    """The record and the message share their field names; kv_bytes stays off the wire."""
    names = {f.name for f in dataclasses.fields(StageTimings)}
    assert set(common_pb2.StageTimings.DESCRIPTOR.fields_by_name) == names - {"kv_bytes"}
    timings = StageTimings(route_ms=1.0, first_token_ms=57.0, decode_allocate_ms=2.0,
                           queued_ms=3.0, prefill_compute_ms=40.0, kv_transfer_ms=5.0,
                           kv_bytes=1e6, handoff_ms=6.0, total_ms=90.0)
    wire = common_pb2.StageTimings.FromString(
        convert.stage_timings_to_proto(timings).SerializeToString())
    assert wire.queued_ms == 3.0 and wire.first_token_ms == 57.0
    assert convert.stage_timings_from_proto(wire) == dataclasses.replace(
        timings, kv_bytes=None, remote_attempt_ms=0.0, local_prefill_ms=0.0)
    # The REST API's object: the stages reached, two of them under their older names.
    assert timings.to_json() == {
        "route_ms": 1.0, "ttft_ms": 57.0, "decode_allocate_ms": 2.0, "prefill_queued_ms": 3.0,
        "prefill_compute_ms": 40.0, "kv_transfer_ms": 5.0, "kv_bytes": 1e6,
        "handoff_ms": 6.0, "total_ms": 90.0}
    assert list(StageTimings(route_ms=1.0, total_ms=2.0).to_json()) == ["route_ms", "total_ms"]


def test_stats_carry_the_load_record() -> None:
    """Both Stats replies are a worker's WorkerLoad (the numbers they have room for)."""
    layout = KVLayout(8, 2, 16, 2, 4, "float32", "m")
    decode = WorkerLoad(running=2, waiting=1, awaiting_kv=3, free_blocks=5, total_blocks=8,
                        prefix_cache_queries=64, prefix_cache_hits=32)
    msg = decode_pb2.DecodeStats.FromString(
        convert.decode_stats_to_proto("d0", decode, layout).SerializeToString())
    assert (msg.worker_id, msg.num_awaiting_transfer, msg.prefix_hit_tokens) == ("d0", 3, 32)
    assert convert.kv_layout_from_proto(msg.layout) == layout
    assert convert.load_from_decode_stats(msg) == decode
    prefill = WorkerLoad(running=1, queued=4, queued_tokens=900, free_blocks=6, total_blocks=8)
    pmsg = prefill_pb2.PrefillStats.FromString(
        convert.prefill_stats_to_proto("p0", prefill, layout).SerializeToString())
    assert (pmsg.worker_id, pmsg.num_queued, pmsg.num_queued_tokens) == ("p0", 4, 900)
    assert convert.load_from_prefill_stats(pmsg) == prefill


def test_a_prompt_read_from_protobuf_is_copied_from_its_field_while_it_is_the_prompt() -> None:
    """`GenerateRequest.prompt_wire`: the worker's message copies the field the router read
    the prompt from (no Python ints), the same message as from the tuple; a copy of the
    request with another prompt sends that prompt; the pair takes no part in equality."""
    msg = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]))
    ids = tuple(msg.token_ids.ids)
    req = GenerateRequest("r", ids, prompt_wire=(ids, msg.token_ids.ids))
    assert req == GenerateRequest("r", ids) and "prompt_wire" not in repr(req)
    assert convert.input_to_proto(req) == convert.input_to_proto(GenerateRequest("r", ids))
    other = dataclasses.replace(req, prompt_token_ids=(9, 9))
    assert list(convert.input_to_proto(other).prompt_token_ids) == [9, 9]
    migrated = dataclasses.replace(req, resume_output_ids=(4,))  # the same prompt
    assert list(convert.input_to_proto(migrated).prompt_token_ids) == [5, 6, 7]
    msg.token_ids.ids.append(8)  # (never done) shows which one is copied
    assert list(convert.input_to_proto(req).prompt_token_ids) == [5, 6, 7, 8]
