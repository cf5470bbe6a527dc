"""Greedy outputs of the engine equal transformers generate, in every scheduling regime."""

from __future__ import annotations

import pytest

from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, run_to_end, tokens


def _requests(prompt_ids: list[list[int]]) -> list[GenerateRequest]:
    return [GenerateRequest(f"r{i}", tuple(ids), greedy()) for i, ids in enumerate(prompt_ids)]


def test_one_at_a_time(make_engine, prompt_ids, hf_reference) -> None:
    engine = make_engine()
    for req, ref in zip(_requests(prompt_ids), hf_reference, strict=True):
        out = run_to_end(engine, [req])
        assert tokens(out[req.request_id]) == ref


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_prefill_chunk": 48, "max_num_batched_tokens": 96}, id="small-chunks"),
        # Steps bounded in time: the first prefill step takes one chunk; once it is measured,
        # a 1 ms target leaves each step the floor of 64 prompt tokens beside its decode rows.
        pytest.param({"step_target_ms": 1.0}, id="time-bounded-steps"),
        # 90 blocks of 16 = 1,440 tokens: every request fits alone, not all together.
        pytest.param({"num_kv_blocks": 90}, id="preemption"),
    ],
)
def test_concurrent(make_engine, prompt_ids, hf_reference, config) -> None:
    engine = make_engine(**config)
    reqs = _requests(prompt_ids)
    # Longest first, so it is admitted and the short ones' growth must preempt something.
    out = run_to_end(engine, reqs[::-1])
    for req, ref in zip(reqs, hf_reference, strict=True):
        assert tokens(out[req.request_id]) == ref, req.request_id
    if "num_kv_blocks" in config:
        assert engine.num_preemptions > 0
    if "max_prefill_chunk" in config:
        assert engine.num_steps > len(prompt_ids[-1]) // 48
    if "step_target_ms" in config:
        assert engine.num_steps > (sum(map(len, prompt_ids)) - 512) // 64


def test_prefix_cache_hit_gives_same_output(make_engine, prompt_ids, hf_reference) -> None:
    engine = make_engine()
    long_ids = tuple(prompt_ids[-1])
    first = run_to_end(engine, [GenerateRequest("a", long_ids, greedy())])["a"]
    assert first[-1].num_cached_tokens == 0
    assert engine.num_cached_tokens(list(long_ids)) >= len(long_ids) - 16
    # Same long prefix, different ending.
    other = long_ids[:-3] + tuple(prompt_ids[0][:3])
    second = run_to_end(engine, [GenerateRequest("b", other, greedy())])["b"]
    assert second[-1].num_cached_tokens > 1000
    fresh = make_engine(enable_prefix_caching=False)
    expected = run_to_end(fresh, [GenerateRequest("c", other, greedy())])["c"]
    assert tokens(second) == tokens(expected)
    # The identical prompt again: served from cache, same tokens as the reference.
    again = run_to_end(engine, [GenerateRequest("d", long_ids, greedy())])["d"]
    assert again[-1].num_cached_tokens > 1000
    assert tokens(again) == hf_reference[-1]
    assert engine.stats().prefix_cache_hit_rate > 0
