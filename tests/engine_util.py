"""Helpers for driving an LLMEngine synchronously in tests."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.types import GenerateRequest, SamplingParams, TokenEvent


def greedy(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def run_to_end(engine: LLMEngine, requests: list[GenerateRequest]) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    return events


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]
