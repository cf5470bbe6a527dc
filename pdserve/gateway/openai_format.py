"""TokenEvents -> OpenAI response objects and stream chunks (completions and chat).

A response has one or more choices (``n`` per prompt, prompts in order); each carries its
``index``. Usage counts every choice's completion tokens and each prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.types import TokenEvent, TokenLogprob


def usage(last: TokenEvent | None, prompt_tokens: int) -> dict[str, Any]:
    prompt = last.num_prompt_tokens if last is not None and last.num_prompt_tokens else \
        prompt_tokens
    completion = last.num_output_tokens if last is not None else 0
    cached = last.num_cached_tokens if last is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def merged_usage(prompts: Sequence[tuple[int, int]], completion_tokens: int) -> dict[str, Any]:
    """Usage of a whole response: ``prompts`` holds (prompt tokens, cached tokens) once per
    prompt; ``completion_tokens`` is the sum over every choice."""
    prompt = sum(p for p, _ in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts)}}


@dataclass
class Choice:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "stop"
    last: TokenEvent | None = None


class _Format:
    """Shared state of one response: identity, and each choice's text offset for logprobs."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Tokenizer,
                 logprobs: bool, num_choices: int = 1):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.num_choices = num_choices
        self._offsets: dict[int, int] = {}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object_name, [])
        out["usage"] = usage
        return out

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []


class CompletionFormat(_Format):
    object_name = chunk_object_name = "text_completion"

    def _logprobs(self, lps: Sequence[TokenLogprob], index: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        offset = self._offsets.get(index, 0)
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(i): v for i, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def _choice(self, text: str, lps: Sequence[TokenLogprob], finish_reason: str | None,
                index: int) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(lps, index),
                "finish_reason": finish_reason}

    def chunk(self, text: str, lps: Sequence[TokenLogprob], finish_reason: str | None,
              index: int = 0) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name,
                              [self._choice(text, lps, finish_reason, index)])

    def response(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.object_name, [
            self._choice(c.text, c.logprobs, c.finish_reason, c.index) for c in choices])
        out["usage"] = usage
        return out


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = [{**self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(i, v) for i, v in lp.top]} for lp in lps]
        return {"content": content, "refusal": None}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self._envelope(self.chunk_object_name, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(self.num_choices)]

    def chunk(self, text: str, lps: Sequence[TokenLogprob], finish_reason: str | None,
              index: int = 0) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(self.chunk_object_name, [
            {"index": index, "delta": delta, "logprobs": self._logprobs(lps),
             "finish_reason": finish_reason}])

    def response(self, choices: Sequence[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.object_name, [
            {"index": c.index, "message": {"role": "assistant", "content": c.text},
             "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}
            for c in choices])
        out["usage"] = usage
        return out


ResponseFormat = CompletionFormat | ChatFormat
