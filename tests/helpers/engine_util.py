"""Helpers for driving an LLMEngine synchronously in tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types import GenerateRequest, SamplingParams, TokenEvent


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll: the engine thread publishes its stats after an abort, on its own schedule."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    assert condition()


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


def remote_prefill(prefill: LLMEngine, decode: LLMEngine,
                   req: GenerateRequest) -> list[TokenEvent]:
    """The disaggregated path in miniature: prefill-only on `prefill`, copy its KV blocks into
    the blocks `decode` allocated, then decode there to the end. Returns `decode`'s events."""
    prefill.add_request(req, prefill_only=True)
    first = None
    while prefill.has_unfinished():
        for ev in prefill.step():
            first = ev
    assert first is not None and first.token_id is not None and first.finished
    src = prefill.held_blocks(req.request_id)
    alloc = decode.allocate_remote(req)
    assert len(alloc.block_ids) == len(src)
    skip = alloc.num_cached_tokens // decode.config.block_size
    for s, d in zip(src[skip:], alloc.block_ids[skip:], strict=True):
        decode.kv_pool[d].copy_(prefill.kv_pool[s])
    prefill.release(req.request_id)
    out = [decode.admit_remote(req.request_id, first.token_id)]
    while decode.has_unfinished():
        out.extend(decode.step())
    return out


@contextlib.asynccontextmanager
async def serving_engine(loaded_model: tuple[Any, Any, str], tokenizer: Any,
                         kv_cache_bytes: int = 128 << 20) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine on the real model; on exit, every KV block must be free again."""
    model, config, mid = loaded_model
    llm = LLMEngine(model, config, EngineConfig(kv_cache_bytes=kv_cache_bytes), model_id=mid,
                    tokenizer=tokenizer)
    async with AsyncEngine(llm) as eng:
        yield eng
    assert llm.block_manager.num_free_blocks == llm.layout.num_blocks, "KV blocks leaked"
