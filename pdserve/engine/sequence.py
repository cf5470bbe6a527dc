"""Per-request state inside the engine. Plain Python: no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockHash
from pdserve.types import FinishReason, LatencyClass, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)computation of its prompt
    RUNNING = "running"  # in the batch: prefilling chunks or decoding
    AWAITING_KV = "awaiting_kv"  # blocks allocated, KV being written from outside the engine
    HELD = "held"  # prefill-only request done; its blocks are kept until released
    FINISHED = "finished"


class SeqMode(enum.Enum):
    GENERATE = "generate"  # prefill then decode to the end
    PREFILL_ONLY = "prefill_only"  # stop after the first token, keep the KV blocks


@dataclass(eq=False)
class Sequence:
    """A request's tokens and progress.

    Invariant: ``num_computed_tokens <= num_tokens``; tokens ``[0, num_computed_tokens)`` have
    their KV in ``block_table``. A step computes ``num_tokens - num_computed_tokens`` tokens (or
    a chunk of them); when it catches up, the step's logits sample the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    latency_class: LatencyClass = LatencyClass.STANDARD
    mode: SeqMode = SeqMode.GENERATE
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled: float = 0.0  # when a step first ran it (0: not yet): its queue time ends
    # Chained hashes of the full blocks of token_ids, computed once each, lazily, by the
    # BlockManager (lookups, allocation, registration); valid across preemptions.
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def priority(self) -> tuple[int, float]:
        return (self.latency_class.priority, self.arrival)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
