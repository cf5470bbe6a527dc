"""Sampling controls on the real model: seeds, top-k/top-p, logprobs, stops, EOS, streaming."""

from __future__ import annotations

import math

import pytest

from pdserve.types import FinishReason, GenerateRequest, SamplingParams, TokenEvent
from tests.helpers.engine_util import greedy, run_to_end, tokens

STORY = "Once upon a time, in a land far away, there lived a"


def _ids(tokenizer, text: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return tuple(tokenizer.encode(text))


def _chat(tokenizer, text: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _one(engine, prompt: tuple[int, ...], sp: SamplingParams,  # type: ignore[no-untyped-def]
         rid: str = "r") -> list[TokenEvent]:
    return run_to_end(engine, [GenerateRequest(rid, prompt, sp)])[rid]


def _text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def test_seeded_sampling_is_reproducible(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = tokens(_one(engine, prompt, sp, "a"))
    assert tokens(_one(engine, prompt, sp, "b")) == alone
    others = [
        GenerateRequest("greedy", _ids(tokenizer, "The capital of France is"), greedy(20)),
        GenerateRequest("unseeded", prompt, SamplingParams(max_tokens=12, temperature=1.0)),
        GenerateRequest("seeded-other", _ids(tokenizer, "1, 1, 2, 3, 5,"),
                        SamplingParams(max_tokens=8, temperature=0.7, seed=7)),
    ]
    batched = run_to_end(engine, [*others[:2], GenerateRequest("c", prompt, sp), others[2]])
    assert tokens(batched["c"]) == alone
    reseeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=4321)
    assert tokens(_one(engine, prompt, reseeded, "d")) != alone


def test_top_k_1_is_greedy(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    ref = tokens(_one(engine, prompt, greedy(12), "g"))
    top1 = SamplingParams(max_tokens=12, temperature=1.5, top_k=1)
    assert tokens(_one(engine, prompt, top1, "k")) == ref


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.5), (3, 1.0), (5, 0.8)])
def test_samples_stay_inside_top_k_and_nucleus(make_engine, tokenizer, top_k: int,
                                               top_p: float) -> None:
    engine = make_engine()
    # temperature 1: the returned logprobs are the distribution that was sampled from.
    sp = SamplingParams(max_tokens=24, temperature=1.0, top_k=top_k, top_p=top_p, seed=3,
                        logprobs=20)
    events = _one(engine, _ids(tokenizer, STORY), sp)
    assert len(tokens(events)) == 24
    for ev in events:
        assert ev.logprob is not None
        ranked = [t for t, _ in ev.logprob.top]
        if ev.token_id in ranked:
            rank = ranked.index(ev.token_id)
            mass_above = sum(math.exp(lp) for _, lp in ev.logprob.top[:rank])
            assert mass_above < top_p + 1e-5
            if top_k:
                assert rank < top_k
        else:
            assert not top_k
            assert sum(math.exp(lp) for _, lp in ev.logprob.top) < top_p + 1e-5


def test_logprobs(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    events = _one(engine, prompt, greedy(8, logprobs=5), "five")
    for ev in events:
        lp = ev.logprob
        assert lp is not None and lp.token_id == ev.token_id
        assert lp.logprob <= 0.0
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0][0] == ev.token_id  # greedy picks the most likely token
        assert lp.top[0][1] == pytest.approx(lp.logprob)
    sampled = _one(engine, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=0,
                                                  logprobs=0), "zero")
    assert all(e.logprob is not None and e.logprob.top == () and e.logprob.logprob <= 0
               for e in sampled)
    assert all(e.logprob is None for e in _one(engine, prompt, greedy(3), "none"))


def test_stop_strings(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    full_events = _one(engine, prompt, greedy(24), "full")
    full = _text(full_events)
    assert full == tokenizer.decode(tokens(full_events))
    # A stop string starting well inside the text, spanning a token boundary if it can.
    start = len(full) // 2
    stop = full[start : start + 5]
    cut = full.find(stop)
    assert cut > 0
    events = _one(engine, prompt, greedy(24, stop=("never-appears", stop)), "stopped")
    assert _text(events) == full[:cut]
    assert events[-1].finish_reason is FinishReason.STOP
    assert tokens(events) == tokens(full_events)[: len(tokens(events))]
    assert len(tokens(events)) < len(tokens(full_events))
    # A stop string that never appears changes nothing.
    events = _one(engine, prompt, greedy(24, stop=("@@@",)), "unstopped")
    assert _text(events) == full and events[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    ref = tokens(_one(engine, prompt, greedy(16), "ref"))
    i = next(i for i in range(2, 16) if ref[i] not in ref[:i])
    events = _one(engine, prompt, greedy(16, stop_token_ids=(ref[i],)), "stopped")
    assert tokens(events) == ref[: i + 1]  # the stop token is returned, then the stream ends
    assert events[-1].finish_reason is FinishReason.STOP


def test_max_tokens_1(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _ids(tokenizer, STORY)
    ref = tokens(_one(engine, prompt, greedy(4), "ref"))
    events = _one(engine, prompt, greedy(1), "one")
    assert len(events) == 1
    assert events[0].token_id == ref[0] and events[0].finish_reason is FinishReason.LENGTH
    assert events[0].num_output_tokens == 1 and events[0].num_prompt_tokens == len(prompt)


def test_eos_ends_with_stop_unless_ignored(make_engine, tokenizer) -> None:
    engine = make_engine()
    prompt = _chat(tokenizer, "Is the sky blue? Answer yes or no.")
    events = _one(engine, prompt, greedy(40), "eos")
    out = tokens(events)
    assert out[-1] in tokenizer.eos_token_ids and len(out) < 40
    assert events[-1].finish_reason is FinishReason.STOP
    assert _text(events) == tokenizer.decode(out)  # the EOS token adds no text
    ignored = _one(engine, prompt, greedy(len(out) + 3, ignore_eos=True), "ignore")
    assert tokens(ignored)[: len(out)] == out and len(tokens(ignored)) == len(out) + 3
    assert ignored[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("text", "sp"),
    [
        pytest.param("Les élèves étudient la physique quantique", greedy(24), id="french"),
        pytest.param("Écris un poème avec des emojis 🙂🚀 et des accents:",
                     SamplingParams(max_tokens=32, temperature=1.3, seed=11), id="emoji-hot"),
        pytest.param("东京是日本的首都。北京是",
                     SamplingParams(max_tokens=32, temperature=1.0, seed=5), id="chinese"),
        pytest.param("def fibonacci(n):\n", greedy(24), id="code"),
    ],
)
def test_streamed_text_concatenates_to_decode(make_engine, tokenizer, text: str,
                                              sp: SamplingParams) -> None:
    engine = make_engine()
    events = _one(engine, _ids(tokenizer, text), sp)
    assert _text(events) == tokenizer.decode(tokens(events))
    assert [e.num_output_tokens for e in events] == list(range(1, len(events) + 1))
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finished
