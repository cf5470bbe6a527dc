"""The token-budget scheduler on its own, driven like the engine drives it. No torch."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.scheduler import (
    MIN_STEP_PREFILL_TOKENS,
    Scheduler,
    SchedulerOutput,
    interactive_prompt_budget,
    step_budget,
)
from pdserve.engine.sequence import SeqMode, SeqStatus, Sequence
from pdserve.types import FinishReason, LatencyClass, SamplingParams

BS = 4
NEXT_TOKEN = 7


def _scheduler(num_blocks: int = 64, **kw: int) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_prefill_chunk", 64)
    kw.setdefault("max_num_seqs", 8)
    config = EngineConfig(block_size=BS, num_kv_blocks=num_blocks, **kw)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, BS))


def _seq(rid: str, n: int, *, offset: int = 0, cls: LatencyClass = LatencyClass.STANDARD,
         mode: SeqMode = SeqMode.GENERATE, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, [offset + i for i in range(n)], SamplingParams(), latency_class=cls,
                    mode=mode, arrival=arrival)


def _step(s: Scheduler) -> SchedulerOutput:
    """schedule -> (model) -> postprocess -> sample NEXT_TOKEN for sequences that caught up."""
    out = s.schedule()
    s.postprocess(out)
    for piece in out.scheduled:
        if piece.samples:
            piece.seq.append_token(NEXT_TOKEN)
    return out


def _plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(p.seq.request_id, p.start, p.num_new_tokens) for p in out.scheduled]


def test_token_budget_is_shared_across_prompts() -> None:
    s = _scheduler(max_num_batched_tokens=32, max_prefill_chunk=32)
    for rid in "abc":
        s.add(_seq(rid, 20, offset=100 * ord(rid)))
    out = _step(s)
    assert _plan(out) == [("a", 0, 20), ("b", 0, 12)]
    assert out.num_tokens == 32
    assert s.num_waiting == 1
    # Next step: a decodes (1), b finishes its prompt (8), c gets what is left (23 of 32).
    assert _plan(_step(s)) == [("a", 20, 1), ("b", 12, 8), ("c", 0, 20)]


def test_running_decodes_come_before_new_prompts() -> None:
    s = _scheduler(max_num_batched_tokens=16, max_prefill_chunk=16)
    s.add(_seq("old", 5))
    _step(s)
    s.add(_seq("new", 40, offset=1000, cls=LatencyClass.INTERACTIVE))
    out = _step(s)
    assert _plan(out) == [("old", 5, 1), ("new", 0, 15)]


def test_long_prompt_is_chunked_and_samples_only_at_its_end() -> None:
    s = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=32)
    seq = _seq("long", 100)
    s.add(seq)
    plans, samples = [], []
    while seq.num_output_tokens == 0:
        out = s.schedule()
        plans += _plan(out)
        samples += [p.samples for p in out.scheduled]  # before the sampled token is appended
        s.postprocess(out)
        if out.scheduled[-1].samples:
            seq.append_token(NEXT_TOKEN)
    assert plans == [("long", 0, 32), ("long", 32, 32), ("long", 64, 32), ("long", 96, 4)]
    assert samples == [False, False, False, True]
    assert seq.num_computed_tokens == 100 and seq.num_tokens == 101


def test_waiting_requests_are_admitted_by_latency_class_then_arrival() -> None:
    s = _scheduler(max_num_seqs=1)
    s.add(_seq("batch", 4, cls=LatencyClass.BATCH, arrival=1.0))
    s.add(_seq("std-late", 4, cls=LatencyClass.STANDARD, arrival=3.0))
    s.add(_seq("interactive", 4, cls=LatencyClass.INTERACTIVE, arrival=4.0))
    s.add(_seq("std-early", 4, cls=LatencyClass.STANDARD, arrival=2.0))
    order = []
    while s.has_work:
        out = _step(s)
        for p in out.scheduled:
            if p.seq.request_id not in order:
                order.append(p.seq.request_id)
        for seq in list(s.running):
            if seq.num_output_tokens >= 2:
                s.finish(seq, FinishReason.LENGTH)
    assert order == ["interactive", "std-early", "std-late", "batch"]
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_a_better_class_prompt_does_not_wait_for_a_running_one_to_finish() -> None:
    """An interactive prompt arriving while a batch prompt is being prefilled in chunks joins
    at the next step and takes its budget first; the batch prompt gets what is left."""
    s = _scheduler(max_num_batched_tokens=16, max_prefill_chunk=16)
    s.add(_seq("batch", 64, cls=LatencyClass.BATCH, arrival=1.0))
    assert _plan(_step(s)) == [("batch", 0, 16)]
    s.add(_seq("interactive", 8, offset=500, cls=LatencyClass.INTERACTIVE, arrival=2.0))
    assert _plan(_step(s)) == [("interactive", 0, 8), ("batch", 16, 8)]
    assert _plan(_step(s)) == [("interactive", 8, 1), ("batch", 24, 15)]
    # A worse class than every running prompt waits as before: for what the budget leaves.
    s.add(_seq("batch-2", 8, offset=900, cls=LatencyClass.BATCH, arrival=3.0))
    assert _plan(_step(s)) == [("interactive", 9, 1), ("batch", 39, 15)]
    assert [q.request_id for q in s.running] == ["interactive", "batch"]


def test_preemption_takes_the_worst_class_first() -> None:
    """Blocks run out: the batch stream yields, though the interactive one was admitted
    after it."""
    s = _scheduler(num_blocks=4)
    b = _seq("batch", 7, cls=LatencyClass.BATCH, arrival=1.0)
    s.add(b)
    _step(s)
    i = _seq("interactive", 7, offset=100, cls=LatencyClass.INTERACTIVE, arrival=2.0)
    s.add(i)
    _step(s)  # the batch stream decodes position 7, the interactive prompt joins: no block left
    assert [q.request_id for q in s.running] == ["interactive", "batch"]
    out = _step(s)  # the batch stream needs a 3rd block for position 8: it yields
    assert out.preempted == [b] and _plan(out) == [("interactive", 7, 1)]
    assert b.status is SeqStatus.WAITING and i.status is SeqStatus.RUNNING


def test_a_better_class_prompt_takes_the_blocks_of_worse_running_ones() -> None:
    """The pool is full of batch streams: an interactive prompt is admitted at once with the
    blocks of the latest batch stream, which is recomputed later. A prompt of the same class
    as the running ones, or one that not even all worse ones' blocks would fit, waits."""
    s = _scheduler(num_blocks=6)
    b1 = _seq("b1", 8, cls=LatencyClass.BATCH, arrival=1.0)
    b2 = _seq("b2", 8, offset=100, cls=LatencyClass.BATCH, arrival=2.0)
    s.add(b1)
    s.add(b2)
    _step(s)  # 2 blocks each, and their first tokens
    _step(s)  # position 8: a 3rd block each; the pool is full
    assert s.bm.num_free_blocks == 0
    s.add(_seq("b3", 4, offset=200, cls=LatencyClass.BATCH, arrival=3.0))
    assert _plan(_step(s)) == [("b1", 9, 1), ("b2", 9, 1)]  # the same class waits
    big = _seq("i-big", 28, offset=300, cls=LatencyClass.INTERACTIVE, arrival=4.0)
    s.add(big)
    out = _step(s)  # 7 blocks: more than all batch streams hold, so nobody yields for it
    assert out.preempted == [] and [q.request_id for q in s.running] == ["b1", "b2"]
    s.finish(big, FinishReason.ABORT)  # it gives up
    i = _seq("i", 7, offset=400, cls=LatencyClass.INTERACTIVE, arrival=5.0)
    s.add(i)
    out = _step(s)  # 2 blocks: b2's 3 are enough
    assert out.preempted == [b2] and b2.status is SeqStatus.WAITING
    assert _plan(out) == [("i", 0, 7), ("b1", 11, 1)]
    assert [q.request_id for q in s.running] == ["i", "b1"]


def test_max_num_seqs_limits_the_running_batch() -> None:
    s = _scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(_seq(f"r{i}", 4, offset=10 * i))
    _step(s)
    assert [q.request_id for q in s.running] == ["r0", "r1"]
    assert s.num_waiting == 1


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 4 blocks of 4 tokens: two 7-token prompts fit (2 blocks each) until they grow past 8.
    s = _scheduler(num_blocks=4)
    a, b = _seq("a", 7), _seq("b", 7, offset=100)
    s.add(a)
    s.add(b)
    _step(s)  # both prefilled, each has sampled one token
    _step(s)  # both decode position 7, the last slot of their second block
    assert s.bm.num_free_blocks == 0
    out = _step(s)  # both need a 3rd block for position 8: the latest admitted yields
    assert out.preempted == [b]
    assert _plan(out) == [("a", 8, 1)]
    assert b.status is SeqStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.token_ids[-1] == NEXT_TOKEN  # its output so far is kept and recomputed
    s.finish(a, FinishReason.LENGTH)
    out = _step(s)
    # b is recomputed from its prompt and output so far. a's growth evicted b's tail block;
    # its head block is still in the prefix cache.
    assert _plan(out) == [("b", 4, 5)]
    assert b.num_cached_tokens == 0  # reports the first admission only
    s.finish(b, FinishReason.LENGTH)
    assert s.bm.num_free_blocks == 4


def test_sequence_preempting_itself_stops_the_step() -> None:
    s = _scheduler(num_blocks=2)
    a = _seq("a", 8)
    s.add(a)
    _step(s)
    out = _step(s)  # needs a 3rd block and nobody else can give one up
    assert out.preempted == [a] and out.scheduled == []
    assert a.status is SeqStatus.WAITING


def test_prefix_cache_hit_skips_computed_blocks_but_keeps_one_token() -> None:
    s = _scheduler()
    first = _seq("first", 8)
    s.add(first)
    _step(s)
    s.finish(first, FinishReason.LENGTH)
    again = _seq("again", 8)
    s.add(again)
    out = _step(s)
    assert _plan(out) == [("again", 4, 4)]  # 8 cached, but the last block is recomputed
    assert again.num_cached_tokens == 4
    s.finish(again, FinishReason.LENGTH)


def test_finish_waiting_and_prefill_only_held_release() -> None:
    s = _scheduler(max_num_seqs=1)
    held = _seq("held", 6, mode=SeqMode.PREFILL_ONLY)
    queued = _seq("queued", 6, offset=50)
    s.add(held)
    s.add(queued)
    _step(s)
    s.finish(queued, FinishReason.ABORT)
    assert s.num_waiting == 0 and queued.status is SeqStatus.FINISHED
    s.finish(held, FinishReason.LENGTH)
    assert held.status is SeqStatus.HELD and "held" in s.held
    assert s.bm.num_free_blocks == s.bm.num_blocks - 2  # KV kept for the transfer
    s.release(held)
    assert s.bm.num_free_blocks == s.bm.num_blocks and not s.has_work


def test_aborted_prefill_only_request_frees_its_blocks() -> None:
    s = _scheduler()
    seq = _seq("p", 6, mode=SeqMode.PREFILL_ONLY)
    s.add(seq)
    _step(s)
    s.finish(seq, FinishReason.ABORT)
    assert seq.status is SeqStatus.FINISHED
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_remote_allocate_then_admit_joins_decoding() -> None:
    s = _scheduler()
    local = _seq("local", 5, offset=500)
    s.add(local)
    _step(s)
    remote = _seq("remote", 10)
    assert s.allocate_remote(remote)
    assert remote.status is SeqStatus.AWAITING_KV and len(remote.block_table) == 3
    assert remote.num_cached_tokens == 0
    assert _plan(_step(s)) == [("local", 5, 1)]  # not scheduled while its KV is in flight
    s.admit_remote(remote, first_token=42)
    assert remote.token_ids[-1] == 42 and remote.num_computed_tokens == 10
    assert _plan(_step(s)) == [("local", 6, 1), ("remote", 10, 1)]
    # Its full blocks now serve other prompts, all of them (no token needs computing here).
    other = _seq("other", 10)
    assert s.allocate_remote(other)
    assert other.num_cached_tokens == 8 and other.block_table[:2] == remote.block_table[:2]
    for seq in (local, remote, other):
        s.finish(seq, FinishReason.ABORT)
    assert s.bm.num_free_blocks == s.bm.num_blocks


def test_remote_allocation_fails_cleanly_when_pool_is_full() -> None:
    s = _scheduler(num_blocks=2)
    seq = _seq("big", 12)
    assert not s.allocate_remote(seq)
    assert seq.block_table == [] and not s.awaiting_kv
    assert s.bm.num_free_blocks == 2


def test_a_chunk_never_takes_the_token_of_a_decode_after_it() -> None:
    s = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=64)
    s.add(_seq("long", 40))
    _step(s)  # long: 40 of 40 prompt tokens
    s.add(_seq("short", 8, offset=1000))
    s.add(_seq("late", 100, offset=2000))
    _step(s)  # long decodes; short prefills; late takes what is left
    # Running order: long (decoding), short (decoding), late (prefilling, 64 - 1 - 8 = 55 done).
    # A budget of 10 leaves late 8 tokens and each decode its one.
    s.running.reverse()  # late first: its chunk is ahead of both decode rows
    out = s.schedule(budget=10)
    assert _plan(out) == [("late", 55, 8), ("short", 8, 1), ("long", 41, 1)]


def test_step_budget_from_time() -> None:
    off = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=2048,
                       step_target_ms=0.0)
    assert step_budget(off, 800.0, 16) == 2048
    timed = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_batched_tokens=2048,
                         step_target_ms=500.0)
    assert step_budget(timed, 0.0, 16) == 16 + 512  # no rate measured yet: one chunk
    assert step_budget(timed, 800.0, 16) == 16 + 400
    assert step_budget(timed, 10.0, 16) == 16 + MIN_STEP_PREFILL_TOKENS
    assert step_budget(timed, 100_000.0, 16) == 2048  # a fast device: the token budget


def test_a_step_with_an_interactive_prompt_cuts_worse_prompt_chunks() -> None:
    s = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=32)
    s.add(_seq("batch", 60, cls=LatencyClass.BATCH))
    s.add(_seq("stream", 4, offset=500, cls=LatencyClass.BATCH))
    _step(s)  # batch 0..32, stream's prompt whole
    s.add(_seq("chat", 6, offset=1000, cls=LatencyClass.INTERACTIVE))
    # chat joins ahead of the unfinished batch prompt; the step's prompt tokens are held to
    # 10: chat's 6, batch's chunk cut to 4; the batch stream's decode row keeps its token.
    out = s.schedule(interactive_budget=10)
    assert _plan(out) == [("chat", 0, 6), ("batch", 32, 4), ("stream", 4, 1)]
    # No cut without an interactive prompt in the step, or without a budget.
    s2 = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=32)
    s2.add(_seq("batch", 60, cls=LatencyClass.BATCH))
    assert _plan(s2.schedule(interactive_budget=10)) == [("batch", 0, 32)]
    s3 = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=32)
    s3.add(_seq("chat", 6, cls=LatencyClass.INTERACTIVE))
    s3.add(_seq("batch", 60, offset=1000, cls=LatencyClass.BATCH))
    assert _plan(s3.schedule()) == [("chat", 0, 6), ("batch", 0, 32)]


def test_the_cut_never_shortens_an_interactive_prompt_or_admits_an_empty_chunk() -> None:
    s = _scheduler(max_num_batched_tokens=64, max_prefill_chunk=32)
    s.add(_seq("chat", 20, cls=LatencyClass.INTERACTIVE))
    s.add(_seq("chat2", 8, offset=500, cls=LatencyClass.INTERACTIVE))
    s.add(_seq("batch", 60, offset=1000, cls=LatencyClass.BATCH))
    # Both interactive prompts take their tokens past the cut's 16; the batch prompt is not
    # admitted (its blocks stay free) in a step with no prompt tokens left for it.
    out = s.schedule(interactive_budget=16)
    assert _plan(out) == [("chat", 0, 20), ("chat2", 0, 8)]
    assert s.num_waiting == 1 and len(s.running) == 2


def test_interactive_prompt_budget_from_time() -> None:
    off = EngineConfig(block_size=BS, num_kv_blocks=64, interactive_step_target_ms=0.0)
    assert interactive_prompt_budget(off, 800.0) is None
    on = EngineConfig(block_size=BS, num_kv_blocks=64, interactive_step_target_ms=250.0)
    assert interactive_prompt_budget(on, 0.0) is None  # no rate measured yet
    assert interactive_prompt_budget(on, 800.0) == 200
    assert interactive_prompt_budget(on, 10.0) == MIN_STEP_PREFILL_TOKENS
