"""The synchronous engine core: one `step()` = schedule -> run the model -> process outputs.

Not thread-safe: exactly one thread drives an LLMEngine (see engine.async_engine).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.free_cpus import FreeCpus
from pdserve.engine.loader import load_model
from pdserve.engine.model_runner import _DTYPES, ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, interactive_prompt_budget, step_budget
from pdserve.engine.sequence import SeqMode, SeqStatus, Sequence
from pdserve.engine.stats import QUEUE_TIME_BUCKETS, DurationHistogram, EngineStats
from pdserve.engine.step_rates import StepRates
from pdserve.errors import CapacityError, ErrorCode, InvalidRequestError, PromptTooLongError
from pdserve.kv_layout import KVLayout
from pdserve.types import FinishReason, GenerateRequest, TokenEvent, TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.grammar import GrammarCompiler, GrammarState
    from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RemoteAllocation:
    """Blocks reserved for a prompt whose KV is written from outside (see allocate_remote)."""

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int  # leading tokens already in the prefix cache: no transfer needed


class LLMEngine:
    def __init__(self, model: Any, model_config: ModelConfig, config: EngineConfig, *,
                 model_id: str, tokenizer: Tokenizer | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.runner = ModelRunner(model, model_config, config, model_id)
        self.block_manager = BlockManager(
            self.runner.layout.num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_extra=model_id.encode())
        self.scheduler = Scheduler(config, self.block_manager)
        self.eos_token_ids = frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammars: dict[str, GrammarState] = {}
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.queue_time = DurationHistogram(QUEUE_TIME_BUCKETS)
        self.rates = StepRates()
        # The CPU a step gets is counted for the whole process (torch's threads and the
        # worker's own), per thread of torch's: a step alone on free CPUs is ~1. With
        # adapt_threads a step may run on fewer; its share still counts all of them (on one
        # of two free CPUs it is ~0.5), which is what the router scales by
        # (router.cost.cpu_factor). Worker records publish it (`WorkerInfo.threads`).
        self.threads = max(1, torch.get_num_threads())
        self._free_cpus: FreeCpus | None = None
        if config.adapt_threads:
            self._free_cpus = FreeCpus()
        self.step_threads = self.threads  # what the last step ran on

    @classmethod
    def from_dir(cls, model_dir: Path, config: EngineConfig | None = None) -> LLMEngine:
        from pdserve.engine.model_store import model_id as compute_model_id
        from pdserve.engine.tokenizer import Tokenizer

        config = config or EngineConfig()
        if config.device == "cpu" and config.dtype in ("bfloat16", "float16"):
            from pdserve.engine.cpu import cpu_info

            if not cpu_info().native_bf16:
                raise InvalidRequestError(
                    f"dtype {config.dtype} needs a CPU with native bf16 (avx512_bf16 or "
                    f"amx_bf16); this one emulates it and is slower than float32 "
                    f"({cpu_info().summary()}). Use float32 (exact) or int8.", param="dtype")
        model, model_config = load_model(model_dir, dtype=_DTYPES[config.activation_dtype],
                                         device=config.device, weight_format=config.dtype)
        mid = compute_model_id(model_dir)
        # KV computed with other weights is other KV: never share blocks or prefixes across.
        if config.dtype != "float32":
            mid = f"{mid}+{config.dtype}"
        return cls(model, model_config, config, model_id=mid, tokenizer=Tokenizer(model_dir))

    # ------------------------------------------------------------------ introspection

    @property
    def layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def kv_pool(self) -> torch.Tensor:
        return self.runner.kv_pool

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=len(s.running), waiting=s.num_waiting, awaiting_kv=len(s.awaiting_kv),
            held=len(s.held), free_blocks=self.block_manager.num_free_blocks,
            total_blocks=self.layout.num_blocks,
            prefix_cache_hit_rate=self.block_manager.prefix_hit_rate,
            steps=self.num_steps, preemptions=self.num_preemptions,
            prefix_cache_queries=self.block_manager.prefix_query_tokens,
            prefix_cache_hits=self.block_manager.prefix_hit_tokens,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_step_s=self.rates.decode_step_s,
            prefill_cpu_share=self.rates.prefill_cpu_share,
            threads=self.step_threads,
            waiting_prompt_tokens=s.waiting_prompt_tokens,
            queue_time=self.queue_time.snapshot())

    def num_cached_tokens(self, token_ids: list[int] | tuple[int, ...]) -> int:
        return self.block_manager.num_cached_tokens(token_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ requests

    def _validate(self, req: GenerateRequest) -> None:
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}",
                                      param="request_id")
        n = len(req.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must remain for the output", param="prompt")
        vocab = self.model_config.vocab_size
        for t in req.token_ids:
            # A non-int would only fail inside a step (hashing, tensors) and take the batch down.
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"token id {t!r} is not an integer", param="prompt")
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t} is outside the vocabulary [0, {vocab})",
                                          param="prompt")
        if self.block_manager.blocks_needed(n + 1) > self.layout.num_blocks:
            raise PromptTooLongError(
                f"prompt has {n} tokens, more than this worker's KV cache can ever hold "
                f"({self.layout.num_blocks * self.config.block_size} tokens)", param="prompt")

    def _new_seq(self, req: GenerateRequest, mode: SeqMode) -> Sequence:
        self._validate(req)
        grammar = self._grammar_state(req.sampling.json_schema)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.sampling,
                       latency_class=req.latency_class, mode=mode)
        self._seqs[req.request_id] = seq
        if grammar is not None:
            self._grammars[req.request_id] = grammar
        if self.tokenizer is not None:
            from pdserve.engine.tokenizer import IncrementalDetokenizer

            detok = self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, req.sampling.stop,
                include_stop=req.sampling.include_stop_str_in_output,
                skip_special_tokens=req.sampling.skip_special_tokens)
            for tok in req.resume_output_ids:  # their text was streamed already
                detok.feed(tok)
        for tok in req.resume_output_ids:  # a migrated request: as if preempted after them
            seq.append_token(tok)
        return seq

    def add_request(self, req: GenerateRequest, *, prefill_only: bool = False) -> None:
        """Queue a request: prefill (chunked) then decode, or prefill only (blocks are held)."""
        seq = self._new_seq(req, SeqMode.PREFILL_ONLY if prefill_only else SeqMode.GENERATE)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> TokenEvent | None:
        """End a request now and free its blocks. Returns its final event, if it was live."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is SeqStatus.HELD:
            self.release(request_id)
            return None
        return self._finish(seq, FinishReason.ABORT)

    def held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Block ids of a finished prefill-only request (valid until `release`)."""
        return tuple(self.scheduler.held[request_id].block_table)

    def preemptions_of(self, request_id: str) -> int:
        """How often a live or held request was preempted (its blocks freed, its prompt
        recomputed)."""
        return self._seqs[request_id].num_preemptions

    def prefill_progress(self, request_id: str) -> tuple[int, tuple[int, ...]] | None:
        """A running request's preemptions so far and its blocks whose KV is computed (full
        blocks of its computed tokens); None when it is not running."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            return None
        full = seq.num_computed_tokens // self.config.block_size
        return seq.num_preemptions, tuple(seq.block_table[:full])

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.status is SeqStatus.HELD:
            self.scheduler.release(seq)

    def allocate_remote(self, req: GenerateRequest) -> RemoteAllocation:
        """Reserve blocks for ``req``'s prompt; its KV will be written from outside.

        Leading blocks already in the prefix cache are shared, so only blocks from
        ``num_cached_tokens`` on need writing. Raises CapacityError when the pool is full.
        """
        seq = self._new_seq(req, SeqMode.GENERATE)
        if not self.scheduler.allocate_remote(seq):
            self._forget(seq)
            raise CapacityError("not enough free KV blocks for the prompt; retry later")
        return RemoteAllocation(req.request_id, tuple(seq.block_table), seq.num_cached_tokens)

    def admit_remote(self, request_id: str, first_token: int,
                     logprob: TokenLogprob | None = None) -> TokenEvent:
        """The KV for a remotely prefilled prompt is in its blocks: start decoding from it."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not SeqStatus.AWAITING_KV:
            raise InvalidRequestError(f"request {request_id!r} is not awaiting KV")
        if not 0 <= first_token < self.model_config.vocab_size:
            raise InvalidRequestError(f"first token {first_token} is outside the vocabulary")
        self.scheduler.admit_remote(seq, first_token)
        return self._process_token(seq, first_token, logprob, appended=True)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[TokenEvent]:
        rate = self.rates.prefill_tokens_per_s
        out = self.scheduler.schedule(
            step_budget(self.config, rate, len(self.scheduler.running)),
            interactive_prompt_budget(self.config, rate))
        self.num_preemptions += len(out.preempted)
        events = []
        for seq in out.preempted:
            # A sequence that alone outgrows the whole pool can never be resumed: end it.
            if self.block_manager.blocks_needed(seq.num_tokens + 1) > self.layout.num_blocks:
                events.append(self._finish(seq, FinishReason.LENGTH))
        if not out.scheduled:
            return events
        now, cpu = time.monotonic(), time.process_time()
        for s in out.scheduled:
            if not s.seq.first_scheduled:
                s.seq.first_scheduled = now
                self.queue_time.observe(now - s.seq.arrival)
        prefill_tokens = sum(s.num_new_tokens for s in out.scheduled
                             if s.start < s.seq.num_prompt_tokens)
        if self._free_cpus is not None:
            self._adapt_threads(self._free_cpus, max(
                (s.seq.num_prompt_tokens for s in out.scheduled
                 if s.start < s.seq.num_prompt_tokens), default=0))
        sampling, logits = self.runner.run(out)
        self.scheduler.postprocess(out)
        self.num_steps += 1
        if sampling:
            seqs = [s.seq for s in sampling]
            tokens, logprobs = self.sampler.sample(logits, seqs, self._constraint(seqs))
            for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
                events.append(self._process_token(seq, tok, lp))
        self.rates.observe(time.monotonic() - now, prefill_tokens,
                           (time.process_time() - cpu) / self.threads)
        return events

    def _adapt_threads(self, free_cpus: FreeCpus, longest_prompt: int) -> None:
        """Run the next step on a thread per CPU that others leave free (at least one;
        `FreeCpus.threads`), `longest_prompt`: the longest prompt it computes a part of.
        torch's thread count is the calling thread's (OpenMP's), and only the engine thread
        runs steps."""
        n = free_cpus.threads(self.threads, longest_prompt)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.step_threads = n

    def close(self) -> None:
        """Stop what the engine runs beside its steps (the free-CPU sampler)."""
        if self._free_cpus is not None:
            self._free_cpus.close()

    def fail_all(self, message: str) -> list[TokenEvent]:
        """End every live request with an error (used when a step raised)."""
        events = []
        for seq in list(self._seqs.values()):
            if seq.status is SeqStatus.HELD:
                continue
            events.append(self._finish(seq, FinishReason.ERROR, error=message))
        return events

    # ------------------------------------------------------------------ outputs

    def _process_token(self, seq: Sequence, tok: int, lp: TokenLogprob | None, *,
                       appended: bool = False) -> TokenEvent:
        if not appended:
            seq.append_token(tok)
        sp = seq.sampling
        reason: FinishReason | None = None
        text = ""
        if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            reason = FinishReason.STOP
        else:
            detok = self._detok.get(seq.request_id)
            if detok is not None:
                text, stopped = detok.feed(tok)
                if stopped:
                    reason = FinishReason.STOP
        if reason is None and (seq.num_output_tokens >= sp.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is None and seq.mode is SeqMode.PREFILL_ONLY:
            reason = FinishReason.LENGTH
        if reason is None:
            return self._event(seq, tok, text, lp)
        return self._finish(seq, reason, token=tok, text=text, logprob=lp)

    def _finish(self, seq: Sequence, reason: FinishReason, *, token: int | None = None,
                text: str = "", logprob: TokenLogprob | None = None,
                error: str | None = None) -> TokenEvent:
        detok = self._detok.pop(seq.request_id, None)
        if detok is not None:
            text += detok.flush()
        self._grammars.pop(seq.request_id, None)
        self.scheduler.finish(seq, reason)
        if seq.status is not SeqStatus.HELD:
            self._seqs.pop(seq.request_id, None)
        return self._event(seq, token, text, logprob, reason, error)

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self._grammars.pop(seq.request_id, None)

    # ------------------------------------------------------------------ structured output

    def _grammar_state(self, schema: str | None) -> GrammarState | None:
        """A fresh matcher for ``schema`` (compiled once per schema; the first compile of a
        schema takes the engine thread for a moment)."""
        if schema is None:
            return None
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the engine's tokenizer",
                                          code=ErrorCode.UNSUPPORTED_PARAMETER,
                                          param="response_format")
            from pdserve.engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer.hf_tokenizer,
                                                     self.model_config.vocab_size)
        return self._grammar_compiler.state(schema)

    def _constraint(self, seqs: list[Sequence]) -> Callable[[torch.Tensor], None] | None:
        rows = [(i, g, seq.output_token_ids) for i, seq in enumerate(seqs)
                if (g := self._grammars.get(seq.request_id)) is not None]
        if not rows:
            return None
        from pdserve.engine.grammar import constrain

        return lambda logits: constrain(logits, rows)

    @staticmethod
    def _event(seq: Sequence, token: int | None, text: str, lp: TokenLogprob | None,
               reason: FinishReason | None = None, error: str | None = None) -> TokenEvent:
        return TokenEvent(
            request_id=seq.request_id, token_id=token, text=text, logprob=lp,
            finish_reason=reason, error=error, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, num_output_tokens=seq.num_output_tokens)

