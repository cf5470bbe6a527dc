"""Logits processors against references: transformers' processors (repetition penalty, min-p,
min new tokens, sequence bias) and vLLM's formula for OpenAI presence/frequency penalties.
Then on the real model: penalties change greedy output as the reference processor does, and
min_tokens holds EOS back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pdserve.engine.sampler import Sampler, apply_processors
from pdserve.errors import InvalidRequestError
from pdserve.types import GenerateRequest, SamplingParams
from tests.helpers.engine_util import remote_prefill, run_to_end, tokens

VOCAB = 64
EOS = 3


@dataclass
class Row:
    sampling: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7, 5])
    output_token_ids: list[int] = field(default_factory=lambda: [9, 9, 10, 6])


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    row = Row(SamplingParams(repetition_penalty=penalty))
    logits = _logits()
    ours = apply_processors(logits, [row])
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    ref = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.0, 1.5)])
def test_presence_frequency_match_vllm_formula(presence: float, frequency: float) -> None:
    row = Row(SamplingParams(presence_penalty=presence, frequency_penalty=frequency))
    logits = _logits()
    ours = apply_processors(logits, [row])
    # vLLM: logits -= frequency * count(output) + presence * (count(output) > 0); prompt unused
    counts = torch.bincount(torch.tensor(row.output_token_ids), minlength=VOCAB).float()
    ref = logits - frequency * counts - presence * (counts > 0).float()
    torch.testing.assert_close(ours, ref[None] if ref.dim() == 1 else ref)


def test_logit_bias_matches_sequence_bias() -> None:
    bias = ((4, 5.0), (11, -100.0), (20, 0.25))
    row = Row(SamplingParams(logit_bias=bias))
    logits = _logits()
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(
        torch.tensor([row.prompt_token_ids + row.output_token_ids]), logits.clone())
    torch.testing.assert_close(apply_processors(logits, [row]), ref)


def test_min_tokens_matches_min_new_tokens() -> None:
    sp = SamplingParams(max_tokens=10, min_tokens=6, stop_token_ids=(12,))
    row = Row(sp)  # 4 outputs so far: still masked
    logits = _logits()
    ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
    ref = MinNewTokensLengthLogitsProcessor(len(row.prompt_token_ids), 6, [EOS, 12])(
        ids, logits.clone())
    torch.testing.assert_close(apply_processors(logits, [row], {EOS}), ref)
    row.output_token_ids += [1, 2]  # 6 out: no longer masked
    torch.testing.assert_close(apply_processors(logits, [row], {EOS}), logits)


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_matches_transformers(min_p: float) -> None:
    """The distribution sampled from is the one MinPLogitsWarper leaves (after temperature)."""
    logits = _logits()
    temperature = 0.8
    warped = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), logits / temperature)
    allowed = set(torch.nonzero(torch.isfinite(warped[0])).flatten().tolist())
    sp = SamplingParams(temperature=temperature, min_p=min_p, seed=1)
    seen = set()
    sampler = Sampler()
    for k in range(400):
        row = Row(sp, output_token_ids=[0] * k)  # a new position each time: a new draw
        (tok,), _ = sampler.sample(logits, [row])
        seen.add(tok)
    assert seen <= allowed
    assert len(seen) >= min(len(allowed), 2)


def test_batch_mixes_processed_and_plain_rows() -> None:
    logits = _logits(3)
    rows = [Row(SamplingParams()), Row(SamplingParams(repetition_penalty=1.5,
                                                      frequency_penalty=0.3)),
            Row(SamplingParams(logit_bias=((1, 3.0),)))]
    out = apply_processors(logits, rows)
    torch.testing.assert_close(out[0], logits[0])
    torch.testing.assert_close(out[1:2], apply_processors(logits[1:2], rows[1:2]))
    torch.testing.assert_close(out[2:3], apply_processors(logits[2:3], rows[2:3]))


def test_plain_rows_are_not_copied() -> None:
    logits = _logits(2)
    assert apply_processors(logits, [Row(SamplingParams()), Row(SamplingParams())]) is logits


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": ((1, 200.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_invalid_values(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param


# ---------------------------------------------------------------------- on the real model


def _reference_greedy(model_dir, prompt: list[int], n: int, penalty: float) -> list[int]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         repetition_penalty=penalty, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_greedy_matches_transformers_generate(make_engine, tokenizer,
                                                                 model_dir) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("one two one two one two one two")
    sp = SamplingParams(max_tokens=12, repetition_penalty=1.4, ignore_eos=True)
    engine = make_engine()
    ours = tokens(run_to_end(engine, [GenerateRequest("rp", tuple(prompt), sp)])["rp"])
    assert ours == _reference_greedy(model_dir, prompt, 12, 1.4)
    plain = tokens(run_to_end(engine, [GenerateRequest(
        "plain", tuple(prompt), SamplingParams(max_tokens=12, ignore_eos=True))])["plain"])
    assert plain != ours


def test_min_tokens_holds_eos_back(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]))
    free = tokens(run_to_end(engine, [GenerateRequest(
        "free", prompt, SamplingParams(max_tokens=64))])["free"])
    assert len(free) < 40  # the model ends its answer on its own
    held = run_to_end(engine, [GenerateRequest(
        "held", prompt, SamplingParams(max_tokens=64, min_tokens=len(free) + 5))])["held"]
    assert len(tokens(held)) >= len(free) + 5
    assert not set(tokens(held)[: len(free) + 5]) & set(tokenizer.eos_token_ids)


def test_penalties_and_seeds_survive_remote_prefill(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Prefill-only on one engine, KV copied, decode on another (as the cluster does): the
    output equals one engine's, since penalty state is rebuilt from the tokens and seeds are
    per position."""
    prompt = tuple(tokenizer.encode("one two three one two three one two three one two"))
    params = [
        SamplingParams(max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=11, min_p=0.05,
                       repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=12,
                       logit_bias=((tokenizer.encode(" four")[0], 3.0),)),
    ]
    single, prefill, decode = make_engine(), make_engine(), make_engine()
    for i, sp in enumerate(params):
        want = tokens(run_to_end(single, [GenerateRequest(f"s{i}", prompt, sp)])[f"s{i}"])
        req = GenerateRequest(f"r{i}", prompt, sp)
        assert tokens(remote_prefill(prefill, decode, req)) == want, i
