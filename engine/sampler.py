"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from engine.types import SamplingParams, TokenLogprob


class Sampler:
    """Samples one token per row of logits. Seeded requests own a torch.Generator each, so a
    request's samples don't depend on what else is in the batch."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator().manual_seed(seed)
            self._generators[request_id] = g
        return g

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprob | None]]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, (rid, sp) in enumerate(zip(request_ids, params, strict=True)):
            if sp.greedy:
                continue
            row = logits[i] / sp.temperature
            if sp.top_k > 0 and sp.top_k < row.shape[-1]:
                kth = torch.topk(row, sp.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if sp.top_p < 1.0:
                sorted_logits, idx = torch.sort(row, descending=True)
                cum = sorted_logits.softmax(-1).cumsum(-1)
                drop = cum - sorted_logits.softmax(-1) > sp.top_p  # keep the token crossing p
                row = row.scatter(0, idx[drop], float("-inf"))
            probs = row.softmax(-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(rid, sp.seed)))
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for row, i in enumerate(want):
                n = params[i].logprobs or 0
                top: tuple[tuple[int, float], ...] = ()
                if n:
                    vals, ids = torch.topk(lp[row], n)
                    top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
                logprobs[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]), top)
        return tokens, logprobs
