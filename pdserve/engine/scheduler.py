"""Continuous-batching scheduler over a per-step token budget. Plain Python: no torch.

One code path for prefill and decode: every running sequence has ``num_computed_tokens``
catching up with ``num_tokens``. Each step serves running sequences first (decodes cost one
token, unfinished prompts a chunk, never so large that a decode after it is left out), then
admits waiting ones, highest latency class first, into what is left of the budget.

Latency classes order everything: the running batch is kept in class order (then arrival),
so a prompt of a better class takes a step's budget before a worse one's unfinished prompt,
and a waiting prompt of a better class than some running unfinished prompt joins the batch
at the start of the step instead of waiting for that prompt to finish (an interactive
prompt arriving behind a 4,000-token batch prompt waits for one step, not for all of its
chunks). When blocks run out the last sequence of that order is preempted (the worst class,
the latest to arrive): its blocks are freed and it is recomputed later (prefix caching makes
that cheap). The same holds for a waiting prompt: one that does not fit in the free blocks
takes those of running sequences of a worse class, the last of the order first, if theirs
are enough (an interactive prompt does not wait for a pool full of batch streams to drain
when their blocks would hold it).

The budget is `max_num_batched_tokens`, or less where the engine sets it from time
(`step_budget`): with `step_target_ms`, the prompt tokens of a step are the measured prefill
rate x that target. A step's length is what every running stream waits for its next token,
and a burst of prompts in one long step delays all their first tokens to its end; smaller
steps let the first prompts of a burst finish early. On a CPU that prefills ~800 tokens/s, a
2,048-token step lasts ~2.7 s; on a GPU the same target leaves the whole token budget.

A step that computes an interactive prompt is held to a shorter target of its own
(`interactive_step_target_ms`, `interactive_prompt_budget`): the prompt tokens of worse
classes scheduled after it are cut so that the step's prompt tokens stay within the measured
rate x that target. The interactive prompt's first token comes at the end of its step, so a
batch prompt's 512-token chunk in the same step would be paid by it; cut, the batch prompt
pays one more step instead. Decode rows keep their token.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import SeqMode, SeqStatus, Sequence
from pdserve.types import FinishReason, LatencyClass

# The fewest prompt tokens a time-bounded step may take, so prompts progress however slow the
# steps are measured to be.
MIN_STEP_PREFILL_TOKENS = 64


def step_budget(config: EngineConfig, prefill_tokens_per_s: float, running: int) -> int:
    """A step's token budget: `config.max_num_batched_tokens`, or with `step_target_ms` and a
    measured prefill rate (tokens/s in steps that prefilled, their decode rows included), one
    token per `running` sequence plus the prompt tokens that rate computes in the target.
    Until a rate is measured, the prompt tokens are one chunk (`max_prefill_chunk`): a cold
    engine's first burst does not make one step of the whole token budget."""
    cap = config.max_num_batched_tokens
    if config.step_target_ms <= 0:
        return cap
    if prefill_tokens_per_s <= 0:
        return min(cap, running + config.max_prefill_chunk)
    prompt = max(MIN_STEP_PREFILL_TOKENS,
                 int(prefill_tokens_per_s * config.step_target_ms / 1000.0))
    return min(cap, running + prompt)


def interactive_prompt_budget(config: EngineConfig, prefill_tokens_per_s: float) -> int | None:
    """The most prompt tokens of a step that computes an interactive prompt: the measured
    prefill rate x `interactive_step_target_ms` (at least MIN_STEP_PREFILL_TOKENS). None: no
    such limit (the target is 0, or no rate is measured yet)."""
    if config.interactive_step_target_ms <= 0 or prefill_tokens_per_s <= 0:
        return None
    return max(MIN_STEP_PREFILL_TOKENS,
               int(prefill_tokens_per_s * config.interactive_step_target_ms / 1000.0))


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This step reaches the end of the sequence, so its logits give the next token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class _PromptCut:
    """One step's prompt tokens once it holds an interactive prompt's chunk: the prompt
    chunks of worse classes after it take at most what is left of `budget` (None: no cut)."""

    __slots__ = ("budget", "interactive", "tokens")

    def __init__(self, budget: int | None):
        self.budget = budget
        self.interactive = False  # an interactive prompt's chunk is in the step
        self.tokens = 0  # prompt tokens scheduled so far

    def limit(self, seq: Sequence, n: int) -> int:
        if (self.budget is None or not self.interactive
                or seq.latency_class is LatencyClass.INTERACTIVE):
            return n
        return max(min(n, self.budget - self.tokens), 0)

    def took(self, seq: Sequence, n: int) -> None:
        self.tokens += n
        if seq.latency_class is LatencyClass.INTERACTIVE:
            self.interactive = True


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.running: list[Sequence] = []
        self._waiting: list[tuple[tuple[int, float], int, Sequence]] = []
        self._counter = itertools.count()
        self.awaiting_kv: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ state

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Tokens still to prefill: waiting sequences' and the unfinished prompts (chunks to
        go) of running ones. A decoding sequence has one token to compute; it is not counted."""
        left = sum(seq.num_tokens - seq.num_computed_tokens for _, _, seq in self._waiting)
        for seq in self.running:
            todo = seq.num_tokens - seq.num_computed_tokens
            if todo > 1:
                left += todo
        return left

    @property
    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.priority, next(self._counter), seq))

    # ------------------------------------------------------------------ scheduling

    def schedule(self, budget: int | None = None,
                 interactive_budget: int | None = None) -> SchedulerOutput:
        """This step's work within `budget` tokens (default `max_num_batched_tokens`). Once
        it holds an interactive prompt's chunk, the prompt chunks of worse classes after it
        are cut so that the step's prompt tokens stay within `interactive_budget` (None: no
        such cut; `interactive_prompt_budget`)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if budget is None else budget
        chunk = self.config.max_prefill_chunk
        cut = _PromptCut(interactive_budget)
        scheduled_ids: set[int] = set()
        # A better class than a running unfinished prompt's joins now, ahead of it.
        worst = max((seq.latency_class.priority for seq in self.running
                     if seq.num_tokens - seq.num_computed_tokens > 1), default=None)
        while (worst is not None and self._waiting and self._waiting[0][0][0] < worst
               and len(self.running) < self.config.max_num_seqs
               and self._admit(self._waiting[0][2]) is not None):
            pass
        while (self._waiting and len(self.running) < self.config.max_num_seqs
               and self._admit_over_worse(out)):
            pass
        # Decode rows not yet served: a prompt's chunk ahead of them leaves them their token.
        decodes = sum(1 for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            todo = seq.num_tokens - seq.num_computed_tokens
            if todo == 1:
                decodes -= 1
                n = 1
            else:
                n = cut.limit(seq, min(todo, chunk, max(budget - decodes, 0)))
                if n == 0:
                    i += 1
                    continue
            while not self.bm.append_slots(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq preempted itself: nothing after it is running either
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            scheduled_ids.add(id(seq))
            budget -= n
            if todo > 1:
                cut.took(seq, n)
            i += 1

        while (self._waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self._waiting[0][2]
            if cut.limit(seq, budget) == 0:
                break  # the step holds an interactive prompt and its prompt tokens are spent
            cached = self._admit(seq)
            if cached is None:
                break
            n = cut.limit(seq, min(seq.num_tokens - cached, chunk, budget))
            out.scheduled.append(ScheduledSeq(seq, cached, n))
            budget -= n
            cut.took(seq, n)
        return out

    def _admit(self, seq: Sequence) -> int | None:
        """Move the first waiting sequence, `seq`, into the running batch with its prompt's
        blocks; its cached tokens, or None (still waiting) when the blocks do not fit."""
        total = seq.num_tokens
        alloc = self.bm.allocate_prompt(seq.request_id, seq.token_ids, total,
                                        max_cached=total - 1, block_hashes=seq.block_hashes)
        if alloc is None:
            return None
        heapq.heappop(self._waiting)
        seq.block_table, cached = alloc
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        seq.status = SeqStatus.RUNNING
        self._run(seq)
        return cached

    def _admit_over_worse(self, out: SchedulerOutput) -> bool:
        """Admit the first waiting sequence with blocks taken from running ones of a worse
        class (the last of the running order first), when the free blocks are too few and
        theirs are enough; the preempted go to `out.preempted`. False: nothing changed."""
        seq = self._waiting[0][2]
        priority = seq.latency_class.priority
        victims = [s for s in reversed(self.running) if s.latency_class.priority > priority]
        needed = self.bm.blocks_needed(seq.num_tokens)
        if not victims or self.bm.can_allocate(needed):
            return False  # nobody to take from, or it fits: admitted in its turn
        freeable = sum(self.bm.blocks_freed_by(v.block_table) for v in victims)
        if self.bm.num_free_blocks + freeable < needed:
            return False  # not even all of them would make room: take nobody's blocks
        if self._admit(seq) is not None:
            return True  # it fits after all (its prefix is cached)
        for victim in victims:
            self._preempt(victim)
            out.preempted.append(victim)
            if self._admit(seq) is not None:
                return True
        return False

    def _run(self, seq: Sequence) -> None:
        """Into the running batch, in class order (then arrival)."""
        bisect.insort(self.running, seq, key=lambda s: s.priority)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.request_id, seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.add(seq)

    def postprocess(self, out: SchedulerOutput) -> None:
        """Advance progress after the model ran; full blocks become reusable prefix blocks."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            self.bm.register_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens,
                                         seq.block_table)

    # ------------------------------------------------------------------ endings

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq``. A prefill-only sequence that finished normally keeps its blocks."""
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting = [e for e in self._waiting if e[2] is not seq]
            heapq.heapify(self._waiting)
        elif seq.status is SeqStatus.AWAITING_KV:
            del self.awaiting_kv[seq.request_id]
        elif seq.status is SeqStatus.HELD:
            del self.held[seq.request_id]
        seq.finish_reason = reason
        if seq.mode is SeqMode.PREFILL_ONLY and reason in (FinishReason.STOP, FinishReason.LENGTH):
            seq.status = SeqStatus.HELD
            self.held[seq.request_id] = seq
            return
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq.request_id, seq.block_table)
        seq.block_table = []

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a held (prefill-only) sequence."""
        del self.held[seq.request_id]
        seq.status = SeqStatus.FINISHED
        self.bm.free(seq.request_id, seq.block_table)
        seq.block_table = []

    # ------------------------------------------------------------------ remote prefill

    def allocate_remote(self, seq: Sequence) -> bool:
        """Reserve blocks for a prompt whose KV will be written from outside the engine."""
        total = seq.num_tokens  # the prompt, and the output of a migrated request
        # Keep at least one block to write, so every transfer carries the completion notice.
        alloc = self.bm.allocate_prompt(seq.request_id, seq.token_ids, total, max_cached=total - 1,
                                        block_hashes=seq.block_hashes)
        if alloc is None:
            return False
        seq.block_table, seq.num_cached_tokens = alloc
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = SeqStatus.AWAITING_KV
        self.awaiting_kv[seq.request_id] = seq
        return True

    def admit_remote(self, seq: Sequence, first_token: int) -> None:
        """The prompt's KV is in place: join the running batch at the first decode step."""
        del self.awaiting_kv[seq.request_id]
        seq.num_computed_tokens = seq.num_tokens
        self.bm.register_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens,
                                     seq.block_table)
        seq.append_token(first_token)
        seq.status = SeqStatus.RUNNING
        self._run(seq)
