"""Resuming a request after tokens it already produced (`resume_output_ids`, issue 11's decode
migration): the continuation is exactly the rest of the uninterrupted stream, token for token
and text for text, for greedy and seeded sampling, penalties, min_tokens and stop strings, on
the local path and through a remote prefill (KV copied block by block into a second engine).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.types import GenerateRequest, SamplingParams
from tests.helpers.engine_util import remote_prefill, run_to_end, tokens

PARAMS = {
    "greedy": SamplingParams(max_tokens=40),
    "seeded": SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234),
    "penalties": SamplingParams(max_tokens=40, temperature=0.7, seed=7, presence_penalty=0.5,
                                frequency_penalty=0.4, repetition_penalty=1.2, min_tokens=30),
    "stop": SamplingParams(max_tokens=40, stop=(" the",), seed=3, temperature=0.5),
}


def _text(events) -> str:  # type: ignore[no-untyped-def]
    return "".join(e.text for e in events)


@pytest.mark.parametrize("name", list(PARAMS))
def test_resume_continues_the_stream(make_engine, prompt_ids, name: str) -> None:
    engine = make_engine()
    sp = PARAMS[name]
    prompt = tuple(prompt_ids[2])
    full = run_to_end(engine, [GenerateRequest("full", prompt, sp)])["full"]
    out = tokens(full)
    assert len(out) >= 6, out
    for cut in (1, len(out) // 2, len(out) - 1):
        req = GenerateRequest(f"resume-{cut}", prompt, sp, resume_output_ids=tuple(out[:cut]))
        rest = run_to_end(engine, [req])[req.request_id]
        assert tokens(rest) == out[cut:], (name, cut)
        # The text streamed before the cut plus the text after it is the whole text.
        before = _text(full[:cut])
        assert before + _text(rest) == _text(full), (name, cut)
        last = rest[-1]
        assert last.finish_reason == full[-1].finish_reason
        assert last.num_output_tokens == len(out) and last.num_prompt_tokens == len(prompt)


def test_resume_through_remote_prefill(make_engine, prompt_ids) -> None:
    """A migrated request prefilled on another worker: prompt + resumed output's KV copied
    into the decoding engine, which continues exactly."""
    src, dst = make_engine(), make_engine()
    sp = PARAMS["seeded"]
    prompt = tuple(prompt_ids[-1])
    out = tokens(run_to_end(dst, [GenerateRequest("full", prompt, sp)])["full"])
    cut = len(out) // 2
    req = GenerateRequest("moved", prompt, sp, resume_output_ids=tuple(out[:cut]))
    assert tokens(remote_prefill(src, dst, req)) == out[cut:]


def test_resume_must_leave_tokens_to_generate(prompt_ids) -> None:
    sp = SamplingParams(max_tokens=3)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        GenerateRequest("r", tuple(prompt_ids[0]), sp, resume_output_ids=(1, 2, 3))
    ok = GenerateRequest("r", tuple(prompt_ids[0]), sp, resume_output_ids=(1, 2))
    assert ok.token_ids == (*prompt_ids[0], 1, 2)
    assert dataclasses.replace(ok, resume_output_ids=()).token_ids == tuple(prompt_ids[0])
