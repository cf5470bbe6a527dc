"""The disaggregated path in miniature: prefill on one engine, copy KV blocks, decode on another."""

from __future__ import annotations

import pytest

from pdserve.types import GenerateRequest
from tests.helpers.engine_util import greedy, remote_prefill, run_to_end, tokens


def _transfer(prefill, decode, req: GenerateRequest) -> list[int]:  # type: ignore[no-untyped-def]
    return tokens(remote_prefill(prefill, decode, req))


def test_prefill_transfer_decode_equals_single_engine(make_engine, prompt_ids,
                                                      hf_reference) -> None:
    prefill, decode = make_engine(), make_engine()
    for i, (ids, ref) in enumerate(zip(prompt_ids, hf_reference, strict=True)):
        req = GenerateRequest(f"x{i}", tuple(ids), greedy())
        assert _transfer(prefill, decode, req) == ref


def test_remote_request_joins_running_batch(make_engine, prompt_ids, hf_reference) -> None:
    prefill, decode = make_engine(), make_engine()
    local = GenerateRequest("local", tuple(prompt_ids[0]), greedy())
    decode.add_request(local)
    decode.step()  # local request is now mid-decode
    remote = GenerateRequest("remote", tuple(prompt_ids[-1]), greedy())
    prefill.add_request(remote, prefill_only=True)
    first = [ev for _ in range(200) if prefill.has_unfinished() for ev in prefill.step()][-1]
    alloc = decode.allocate_remote(remote)
    for s, d in zip(prefill.held_blocks("remote"), alloc.block_ids, strict=True):
        decode.kv_pool[d].copy_(prefill.kv_pool[s])
    prefill.release("remote")
    events = [decode.admit_remote("remote", first.token_id)]
    while decode.has_unfinished():
        events.extend(decode.step())
    assert tokens([e for e in events if e.request_id == "remote"]) == hf_reference[-1]


def test_remote_allocation_reuses_decode_prefix_cache(make_engine, prompt_ids,
                                                      hf_reference) -> None:
    prefill, decode = make_engine(), make_engine()
    long_ids = tuple(prompt_ids[-1])
    run_to_end(decode, [GenerateRequest("warm", long_ids, greedy(max_tokens=1))])
    req = GenerateRequest("again", long_ids, greedy())
    alloc = decode.allocate_remote(req)
    assert alloc.num_cached_tokens >= len(long_ids) - 16
    decode.abort("again")
    assert _transfer(prefill, decode, GenerateRequest("again2", long_ids, greedy())) == \
        hf_reference[-1]


def test_abort_while_awaiting_kv_frees_blocks(make_engine, prompt_ids) -> None:
    decode = make_engine()
    free = decode.block_manager.num_free_blocks
    decode.allocate_remote(GenerateRequest("gone", tuple(prompt_ids[-1]), greedy()))
    assert decode.block_manager.num_free_blocks < free
    decode.abort("gone")
    assert decode.block_manager.num_free_blocks == free
    with pytest.raises(Exception, match="not awaiting KV"):
        decode.admit_remote("gone", 1)
