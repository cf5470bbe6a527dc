"""Token sampling: logits processors (bias, min_tokens, penalties), greedy, temperature,
min-p, top-k, top-p, per-request seeds, logprobs.

Everything here is a function of a request's parameters and its token ids, so the sampler
keeps no per-request state: a decode worker that received a request after remote prefill
samples exactly what the prefill worker's engine would have sampled had it kept going.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import torch

from pdserve.types import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
_MIN_TEMPERATURE = 1e-5  # below this, sampling is argmax (as vLLM)


class SampleRow(Protocol):
    """What the sampler reads of a request (engine.sequence.Sequence has it)."""

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


def step_seed(seed: int, step: int) -> int:
    """The generator seed for a request's ``step``-th output token (splitmix64 of both).

    Seeding per position instead of carrying one generator along makes a seeded request's
    samples depend only on (seed, position, logits): the same through local and remote prefill,
    and the same whatever else is in the batch.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def apply_processors(logits: torch.Tensor, rows: Sequence[SampleRow],
                     eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """Logits after min_tokens, logit_bias and the penalties (a new tensor where any applies).

    Order as vLLM: min_tokens masks EOS and stop token ids, then logit_bias, then repetition
    (prompt + output tokens), frequency and presence (output tokens) penalties.
    """
    vocab = logits.shape[-1]
    active = [i for i, r in enumerate(rows) if _needs_processing(r)]
    if not active:
        return logits
    logits = logits.clone()
    for i in active:
        r, sp = rows[i], rows[i].sampling
        if sp.min_tokens and len(r.output_token_ids) < sp.min_tokens:
            stops = [t for t in (*eos_token_ids, *sp.stop_token_ids) if 0 <= t < vocab]
            if stops:
                logits[i, stops] = float("-inf")
        if sp.logit_bias:
            ids = [t for t, _ in sp.logit_bias if t < vocab]
            if ids:
                bias = torch.tensor([b for t, b in sp.logit_bias if t < vocab],
                                    dtype=logits.dtype)
                logits[i].index_add_(0, torch.tensor(ids, dtype=torch.long), bias)
    penalized = [i for i in active if rows[i].sampling.has_penalties]
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [rows[i] for i in penalized])
    return logits


def _needs_processing(r: SampleRow) -> bool:
    sp = r.sampling
    return bool(sp.has_penalties or sp.logit_bias
                or (sp.min_tokens and len(r.output_token_ids) < sp.min_tokens))


def _counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[rows, vocab] occurrence counts (float), built in one scatter over padded rows."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1)
    if width:
        ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for j, toks in enumerate(token_lists):
            if toks:
                ids[j, : len(toks)] = torch.tensor(list(toks), dtype=torch.long).clamp_(0, vocab)
        counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[-1]
    out_counts = _counts([r.output_token_ids for r in rows], vocab).to(logits.dtype)
    seen_out = out_counts > 0

    def col(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.sampling, name) for r in rows],
                            dtype=logits.dtype)[:, None]

    rep = col("repetition_penalty")
    if bool((rep != 1.0).any()):
        seen = seen_out | (_counts([r.prompt_token_ids for r in rows], vocab) > 0)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    return logits - col("frequency_penalty") * out_counts - col("presence_penalty") * seen_out


class Sampler:
    """Samples one token per row of logits."""

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               constrain: Callable[[torch.Tensor], None] | None = None) -> tuple[
            list[int], list[TokenLogprob | None]]:
        """``constrain`` masks disallowed tokens in place (a grammar) in the processed logits;
        logprobs stay those of the model's distribution."""
        params = [r.sampling for r in rows]
        processed = apply_processors(logits, rows, self.eos_token_ids)
        if constrain is not None:
            if processed is logits:
                processed = logits.clone()
            constrain(processed)
        tokens = processed.argmax(dim=-1).tolist()
        for i, (r, sp) in enumerate(zip(rows, params, strict=True)):
            if sp.temperature < _MIN_TEMPERATURE:  # greedy, or so close that 1/T overflows
                continue
            row = processed[i] / sp.temperature
            if sp.min_p > 0.0:
                probs = row.softmax(-1)
                row = row.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
            if sp.top_k > 0 and sp.top_k < row.shape[-1]:
                kth = torch.topk(row, sp.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if sp.top_p < 1.0:
                sorted_logits, idx = torch.sort(row, descending=True)
                cum = sorted_logits.softmax(-1).cumsum(-1)
                drop = cum - sorted_logits.softmax(-1) > sp.top_p  # keep the token crossing p
                row = row.scatter(0, idx[drop], float("-inf"))
            probs = row.softmax(-1)
            gen = None
            if sp.seed is not None:
                gen = torch.Generator().manual_seed(step_seed(sp.seed, len(r.output_token_ids)))
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if want:
            # Logprobs of the model's distribution (vLLM's default), before any processor.
            lp = torch.log_softmax(logits[want], dim=-1)
            for row_i, i in enumerate(want):
                n = params[i].logprobs or 0
                top: tuple[tuple[int, float], ...] = ()
                if n:
                    vals, ids = torch.topk(lp[row_i], n)
                    top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
                logprobs[i] = TokenLogprob(tokens[i], float(lp[row_i, tokens[i]]), top)
        return tokens, logprobs
