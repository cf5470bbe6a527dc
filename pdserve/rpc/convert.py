"""Domain dataclasses (`pdserve.types`, `pdserve.control.load`) <-> `pdserve.v1` messages.

Only the servicers and the typed clients import this (and the generated stubs): domain code
speaks dataclasses. Requests travel as one `GenerateInput` message (`input_to_proto` /
`request_from_proto`); stage timings as `StageTimings`, field by field under the proto's own
names (`stage_timings_to_proto` / `stage_timings_from_proto`); a worker's Stats reply as its
`WorkerLoad` (`decode_stats_to_proto` / `load_from_decode_stats`, and the prefill pair).
"""

from __future__ import annotations

import dataclasses

from pdserve.control.load import WorkerLoad
from pdserve.errors import ErrorCode, InvalidRequestError
from pdserve.kv_layout import KVDestination, KVLayout
from pdserve.types import (
    FinishReason,
    GenerateRequest,
    LatencyClass,
    PrefillReport,
    SamplingParams,
    StageTimings,
    TokenEvent,
    TokenLogprob,
    fit_max_tokens,
)
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

_LATENCY_TO_PROTO = {
    LatencyClass.INTERACTIVE: common_pb2.LATENCY_CLASS_INTERACTIVE,
    LatencyClass.STANDARD: common_pb2.LATENCY_CLASS_STANDARD,
    LatencyClass.BATCH: common_pb2.LATENCY_CLASS_BATCH,
}
_LATENCY_FROM_PROTO: dict[int, LatencyClass] = {
    **{v: k for k, v in _LATENCY_TO_PROTO.items()},
    common_pb2.LATENCY_CLASS_UNSPECIFIED: LatencyClass.STANDARD,
}
_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}
_INT64 = (-(2**63), 2**63 - 1)


def latency_to_proto(latency: LatencyClass) -> common_pb2.LatencyClass:
    return _LATENCY_TO_PROTO[latency]


def latency_from_proto(value: int) -> LatencyClass:
    """UNSPECIFIED means STANDARD; a value this build does not know is an invalid request."""
    try:
        return _LATENCY_FROM_PROTO[value]
    except KeyError as exc:
        raise InvalidRequestError(f"unknown latency class {value}",
                                  code=ErrorCode.INVALID_LATENCY_CLASS,
                                  param="latency_class") from exc


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None while unfinished (UNSPECIFIED); an unknown value reads as ERROR."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    if params.seed is not None and not _INT64[0] <= params.seed <= _INT64[1]:
        raise InvalidRequestError("seed must fit in a signed 64-bit integer",
                                  code=ErrorCode.INVALID_SAMPLING_PARAMS, param="seed")
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
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        json_schema=params.json_schema,
    )


def sampling_wire(params: SamplingParams) -> bytes:
    """`sampling_to_proto(params)` serialized, remembered by the very instance: requests
    share a few SamplingParams (`sampling_from_proto` makes one per distinct message), and
    building the message field by field is most of what a worker's message costs the
    router. Bounded like `_SAMPLING_MADE`."""
    made = _SAMPLING_WIRE.get(id(params))
    if made is not None and made[0] is params:
        return made[1]
    wire = sampling_to_proto(params).SerializeToString()
    if len(_SAMPLING_WIRE) >= _SAMPLING_MADE_MAX:
        _SAMPLING_WIRE.clear()
    _SAMPLING_WIRE[id(params)] = (params, wire)  # kept alive with it: its id stays its own
    return wire


_DEFAULT_SAMPLING = SamplingParams()  # frozen: one instance serves every unset field
# SamplingParams already made, by their message's bytes: requests repeat a few settings, and
# SamplingParams' validation is a lot of code to run on a request's first step, which runs
# cold (docs/bench/router_harness_spr/README.md). Frozen, so one instance serves every
# request that sent the same bytes; cleared when full. Longer messages (a JSON schema, many
# stop strings) are converted every time.
_SAMPLING_MADE: dict[bytes, SamplingParams] = {}
_SAMPLING_MADE_MAX = 1024
_SAMPLING_KEY_MAX_BYTES = 512
_SAMPLING_WIRE: dict[int, tuple[SamplingParams, bytes]] = {}


def sampling_from_proto(msg: common_pb2.SamplingParams | None) -> SamplingParams:
    """Unset fields take the domain defaults; raises InvalidRequestError on invalid values."""
    if msg is None:
        return _DEFAULT_SAMPLING
    key = msg.SerializeToString(deterministic=True)
    if (made := _SAMPLING_MADE.get(key)) is not None:
        return made
    params = _sampling_from_proto(msg)
    if len(key) <= _SAMPLING_KEY_MAX_BYTES:
        if len(_SAMPLING_MADE) >= _SAMPLING_MADE_MAX:
            _SAMPLING_MADE.clear()
        _SAMPLING_MADE[key] = params
    return params


def _sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    defaults = _DEFAULT_SAMPLING
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
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else defaults.repetition_penalty),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_p=msg.min_p,
        min_tokens=msg.min_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=(msg.skip_special_tokens if msg.HasField("skip_special_tokens")
                             else defaults.skip_special_tokens),
        json_schema=msg.json_schema if msg.HasField("json_schema") else None,
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


def kv_layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(**layout.to_wire())  # KVLayout's one codec


def kv_layout_from_proto(msg: common_pb2.KVLayout) -> KVLayout:
    return KVLayout.from_wire(msg)  # validated like a descriptor's layout (ValueError)


def destination_to_allocate_response(d: KVDestination) -> decode_pb2.AllocateResponse:
    if d.layout is None:
        raise ValueError("an AllocateRemote answer carries the decode worker's KV layout")
    return decode_pb2.AllocateResponse(
        block_ids=list(d.block_ids), num_cached_tokens=d.num_cached_tokens,
        descriptor_id=d.descriptor_id, transfer_id=d.transfer_id,
        layout=kv_layout_to_proto(d.layout))


def destination_from_allocate_response(request_id: str, msg: decode_pb2.AllocateResponse
                                       ) -> KVDestination:
    return KVDestination(request_id, tuple(msg.block_ids), msg.num_cached_tokens,
                         msg.descriptor_id, msg.transfer_id, kv_layout_from_proto(msg.layout))


def destination_to_proto(d: KVDestination) -> prefill_pb2.KVDestination:
    return prefill_pb2.KVDestination(descriptor_id=d.descriptor_id, block_ids=d.block_ids,
                                     num_cached_tokens=d.num_cached_tokens,
                                     transfer_id=d.transfer_id)


def destination_from_proto(request_id: str, msg: prefill_pb2.KVDestination) -> KVDestination:
    """InvalidRequestError unless it names a pool, a transfer and some blocks."""
    if not msg.descriptor_id or not msg.transfer_id or not msg.block_ids:
        raise InvalidRequestError("destination needs descriptor_id, transfer_id and block_ids",
                                  param="destination")
    return KVDestination(request_id, tuple(msg.block_ids), msg.num_cached_tokens,
                         msg.descriptor_id, msg.transfer_id)


def prefill_report_to_proto(request_id: str, report: PrefillReport
                            ) -> prefill_pb2.PrefillResponse:
    return prefill_pb2.PrefillResponse(
        request_id=request_id,
        timings=common_pb2.StageTimings(queued_ms=report.queued_ms,
                                        prefill_compute_ms=report.compute_ms,
                                        kv_transfer_ms=report.transfer_ms),
        bytes_transferred=report.bytes_transferred,
        num_computed_tokens=report.num_computed_tokens, worker_id=report.worker_id)


def prefill_report_from_proto(msg: prefill_pb2.PrefillResponse, worker_id: str = ""
                              ) -> PrefillReport:
    """`worker_id`: who was called, for an answer that does not name itself."""
    t = msg.timings
    return PrefillReport(msg.worker_id or worker_id, t.queued_ms, t.prefill_compute_ms,
                         t.kv_transfer_ms, msg.bytes_transferred, msg.num_computed_tokens)


def input_to_proto(request: GenerateRequest) -> common_pb2.GenerateInput:
    """The GenerateInput every worker rpc that starts generation carries."""
    return fill_input(common_pb2.GenerateInput(), request)


def fill_input(dst: common_pb2.GenerateInput, request: GenerateRequest, *,
               prompt: bool = True) -> common_pb2.GenerateInput:
    """`input_to_proto` written into `dst`, an empty GenerateInput inside the message that
    carries it: a GenerateInput passed to a message's constructor is copied, prompt and all
    (a 1,500-token prompt's ids copied twice more cost the router ~50 us per request).
    Without `prompt`, the prompt's ids are left out (the router's compiled data plane
    appends them as the client sent them)."""
    dst.SetInParent()
    dst.request_id = request.request_id
    wire = request.prompt_wire  # the field the prompt was read from, if it still is it
    if prompt:
        dst.prompt_token_ids.extend(wire[1] if wire is not None and wire[0] is
                                    request.prompt_token_ids else request.prompt_token_ids)
    dst.sampling.MergeFromString(sampling_wire(request.sampling))  # empty: a copy
    dst.latency_class = latency_to_proto(request.latency_class)
    dst.resume_output_ids.extend(request.resume_output_ids)
    return dst


def request_from_proto(
    msg: common_pb2.GenerateInput, max_model_len: int | None = None
) -> GenerateRequest:
    """GenerateRequest from a GenerateInput; raises InvalidRequestError on invalid values, and
    PromptTooLongError when the prompt plus max_tokens exceed `max_model_len` (when given)."""
    req = GenerateRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling if msg.HasField("sampling") else None),
        latency_class=latency_from_proto(msg.latency_class),
        resume_output_ids=tuple(msg.resume_output_ids),
    )
    if max_model_len is not None:
        fit_max_tokens(len(req.prompt_token_ids), req.sampling.max_tokens, max_model_len,
                       default=req.sampling.max_tokens)
    return req


def token_event_to_chunk(event: TokenEvent) -> decode_pb2.TokenChunk:
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


# The StageTimings fields the message carries: all but kv_bytes, copied by name.
_STAGE_FIELDS = tuple(f.name for f in dataclasses.fields(StageTimings)
                      if f.name in common_pb2.StageTimings.DESCRIPTOR.fields_by_name)


def stage_timings_to_proto(timings: StageTimings) -> common_pb2.StageTimings:
    """The stages reached (a stage not reached stays 0 on the wire)."""
    return common_pb2.StageTimings(**{name: value for name in _STAGE_FIELDS
                                      if (value := getattr(timings, name)) is not None})


def stage_timings_from_proto(msg: common_pb2.StageTimings) -> StageTimings:
    """Every stage of the message (0: not reached, as on the wire; no kv_bytes)."""
    return StageTimings(**{name: getattr(msg, name) for name in _STAGE_FIELDS})


# The Stats RPCs answer with the worker's load record, the one its heartbeats publish (what a
# worker's Stats message has beyond it, e.g. its throughput, stays 0 as before).

def decode_stats_to_proto(worker_id: str, load: WorkerLoad, layout: KVLayout
                          ) -> decode_pb2.DecodeStats:
    return decode_pb2.DecodeStats(
        worker_id=worker_id, num_running=int(load.running), num_waiting=int(load.waiting),
        num_awaiting_transfer=int(load.awaiting_kv), num_total_blocks=int(load.total_blocks),
        num_free_blocks=int(load.free_blocks),
        prefix_query_tokens=int(load.prefix_cache_queries or 0),
        prefix_hit_tokens=int(load.prefix_cache_hits or 0), layout=kv_layout_to_proto(layout))


def load_from_decode_stats(msg: decode_pb2.DecodeStats) -> WorkerLoad:
    return WorkerLoad(running=msg.num_running, waiting=msg.num_waiting,
                      awaiting_kv=msg.num_awaiting_transfer, total_blocks=msg.num_total_blocks,
                      free_blocks=msg.num_free_blocks, prefix_cache_queries=msg.prefix_query_tokens,
                      prefix_cache_hits=msg.prefix_hit_tokens)


def prefill_stats_to_proto(worker_id: str, load: WorkerLoad, layout: KVLayout
                           ) -> prefill_pb2.PrefillStats:
    return prefill_pb2.PrefillStats(
        worker_id=worker_id, num_queued=int(load.queued), num_running=int(load.running),
        num_queued_tokens=int(load.queued_tokens), num_total_blocks=int(load.total_blocks),
        num_free_blocks=int(load.free_blocks), layout=kv_layout_to_proto(layout))


def load_from_prefill_stats(msg: prefill_pb2.PrefillStats) -> WorkerLoad:
    return WorkerLoad(queued=msg.num_queued, running=msg.num_running,
                      queued_tokens=msg.num_queued_tokens, total_blocks=msg.num_total_blocks,
                      free_blocks=msg.num_free_blocks)
