"""TokenEvents -> OpenAI response objects and stream chunks (`gateway.protocol` models).

A response has one or more choices (``n`` per prompt, prompts in order); each carries its
``index``. Usage counts every choice's completion tokens and each prompt once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import ErrorCode
from pdserve.gateway.errors import APIError, internal, unavailable
from pdserve.gateway.protocol import (
    AssistantMessage,
    Body,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    FinishReasonName,
    PdserveInfo,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from pdserve.types import FinishReason, TokenEvent, TokenLogprob


def usage(prompts: Sequence[tuple[int, int]], completion_tokens: int) -> Usage:
    """Usage of a whole response: ``prompts`` holds (prompt tokens, cached tokens) once per
    prompt; ``completion_tokens`` is the sum over every choice."""
    prompt = sum(p for p, _ in prompts)
    return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                 total_tokens=prompt + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(c for _, c in prompts)))


@dataclass
class Choice:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReasonName = "stop"
    last: TokenEvent | None = None


class _Builder:
    """Shared state of one response: identity, and each choice's text offset for logprobs."""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Tokenizer,
                 logprobs: bool, num_choices: int = 1):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.num_choices = num_choices
        self._offsets: dict[int, int] = {}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionBuilder(_Builder):
    def _logprobs(self, lps: Sequence[TokenLogprob], index: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        offset = self._offsets.get(index, 0)
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._offsets[index] = offset
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{self._token(i): v for i, v in lp.top} for lp in lps],
            text_offset=offsets)

    def opening_chunks(self) -> list[CompletionChunk]:
        return []

    def chunk(self, text: str, lps: Sequence[TokenLogprob], finish_reason: FinishReasonName
              | None, index: int = 0) -> CompletionChunk:
        return self._chunk([CompletionChunkChoice(
            index=index, text=text, logprobs=self._logprobs(lps, index),
            finish_reason=finish_reason)])

    def usage_chunk(self, used: Usage) -> CompletionChunk:
        chunk = self._chunk([])
        chunk.usage = used
        return chunk

    def _chunk(self, choices: list[CompletionChunkChoice]) -> CompletionChunk:
        return CompletionChunk(id=self.request_id, object="text_completion",
                               created=self.created, model=self.model, choices=choices)

    def response(self, choices: Sequence[Choice], used: Usage) -> Completion:
        return Completion(
            id=self.request_id, object="text_completion", created=self.created,
            model=self.model, usage=used, choices=[CompletionChoice(
                index=c.index, text=c.text, logprobs=self._logprobs(c.logprobs, c.index),
                finish_reason=c.finish_reason) for c in choices])


class ChatBuilder(_Builder):
    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        token = self._token(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        content = [ChatTokenLogprob(**self._entry(lp.token_id, lp.logprob).body(),
                                    top_logprobs=[self._entry(i, v) for i, v in lp.top])
                   for lp in lps]
        return ChatLogprobs(content=content, refusal=None)

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        return [self._chunk([ChatChunkChoice(
            index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
            finish_reason=None)]) for i in range(self.num_choices)]

    def chunk(self, text: str, lps: Sequence[TokenLogprob], finish_reason: FinishReasonName
              | None, index: int = 0) -> ChatCompletionChunk:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return self._chunk([ChatChunkChoice(index=index, delta=delta,
                                            logprobs=self._logprobs(lps),
                                            finish_reason=finish_reason)])

    def usage_chunk(self, used: Usage) -> ChatCompletionChunk:
        chunk = self._chunk([])
        chunk.usage = used
        return chunk

    def _chunk(self, choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices)

    def response(self, choices: Sequence[Choice], used: Usage) -> ChatCompletion:
        return ChatCompletion(
            id=self.request_id, object="chat.completion", created=self.created,
            model=self.model, usage=used, choices=[ChatChoice(
                index=c.index, message=AssistantMessage(role="assistant", content=c.text),
                logprobs=self._logprobs(c.logprobs), finish_reason=c.finish_reason)
                for c in choices])


ResponseBuilder = CompletionBuilder | ChatBuilder


def finish_error(ev: TokenEvent, retry_after_s: int) -> APIError | None:
    """The error a final event reports, if it failed."""
    if ev.finish_reason is FinishReason.ERROR:
        return internal(f"generation failed: {ev.error or 'engine error'}",
                        ErrorCode.ENGINE_ERROR)
    if ev.finish_reason is FinishReason.ABORT:
        return unavailable("the server aborted the request", code=ErrorCode.ABORTED,
                           retry_after_s=retry_after_s)
    return None


def finish_reason(ev: TokenEvent) -> FinishReasonName:
    return "length" if ev.finish_reason is FinishReason.LENGTH else "stop"


def pdserve_info(ev: TokenEvent) -> PdserveInfo:
    return PdserveInfo(route=ev.route,
                       timings_ms=ev.timings.to_json() if ev.timings is not None else {})


def sse_data(obj: Body | APIError) -> bytes:
    """One server-sent event; its JSON escapes non-ASCII (``ensure_ascii``), as always."""
    return b"data: " + json.dumps(obj.body(), separators=(",", ":")).encode() + b"\n\n"
