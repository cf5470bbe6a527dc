"""TokenEvents -> OpenAI response objects and stream chunks (completions and chat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer
from engine.types import TokenEvent, TokenLogprob


def usage(last: TokenEvent | None, prompt_tokens: int) -> dict[str, Any]:
    prompt = last.num_prompt_tokens if last is not None and last.num_prompt_tokens else \
        prompt_tokens
    completion = last.num_output_tokens if last is not None else 0
    cached = last.num_cached_tokens if last is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Format:
    """Shared state of one response: identity, and the running text offset for logprobs."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Tokenizer,
                 logprobs: bool):
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self._offset = 0

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

    def _logprobs(self, lps: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(i): v for i, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def _choice(self, text: str, lps: Sequence[TokenLogprob],
                finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(lps),
                "finish_reason": finish_reason}

    def chunk(self, text: str, lps: Sequence[TokenLogprob],
              finish_reason: str | None) -> dict[str, Any]:
        return self._envelope(self.chunk_object_name, [self._choice(text, lps, finish_reason)])

    def response(self, text: str, lps: Sequence[TokenLogprob], finish_reason: str,
                 usage: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.object_name, [self._choice(text, lps, finish_reason)])
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
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}])]

    def chunk(self, text: str, lps: Sequence[TokenLogprob],
              finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(self.chunk_object_name, [
            {"index": 0, "delta": delta, "logprobs": self._logprobs(lps),
             "finish_reason": finish_reason}])

    def response(self, text: str, lps: Sequence[TokenLogprob], finish_reason: str,
                 usage: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(self.object_name, [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "logprobs": self._logprobs(lps), "finish_reason": finish_reason}])
        out["usage"] = usage
        return out


ResponseFormat = CompletionFormat | ChatFormat
