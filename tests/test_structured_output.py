"""response_format json_object / json_schema through xgrammar: the output parses and matches
the schema, on one engine, through a prefill/decode hand-over, and over the REST gateway."""

from __future__ import annotations

import json

import pytest

from pdserve.types import GenerateRequest, SamplingParams
from tests.helpers.engine_util import run_to_end, tokens

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "colors": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "colors"], "additionalProperties": False}


def _chat(tokenizer, text: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return tuple(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _check(obj: object) -> None:
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "colors"}
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
    assert isinstance(obj["colors"], list) and all(isinstance(c, str) for c in obj["colors"])


def test_json_schema_output_matches(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    prompt = _chat(tokenizer, "Describe a person as JSON.")
    for i, sp in enumerate([
            SamplingParams(max_tokens=120, json_schema=json.dumps(SCHEMA)),
            SamplingParams(max_tokens=120, json_schema=json.dumps(SCHEMA), temperature=1.0,
                           seed=4)]):
        events = run_to_end(engine, [GenerateRequest(f"s{i}", prompt, sp)])[f"s{i}"]
        assert events[-1].finish_reason.value == "stop"
        _check(json.loads("".join(e.text for e in events)))


def test_json_object(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    sp = SamplingParams(max_tokens=200, json_schema='{"type": "object"}', temperature=0.7,
                        seed=1)
    events = run_to_end(engine, [GenerateRequest(
        "o", _chat(tokenizer, "Give me a JSON object about cats."), sp)])["o"]
    if events[-1].finish_reason.value == "stop":
        assert isinstance(json.loads("".join(e.text for e in events)), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert "".join(e.text for e in events).lstrip().startswith("{")


def test_grammar_survives_remote_prefill(make_engine, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The decode worker rebuilds the matcher from the output tokens (the first token,
    sampled under the grammar on the prefill side)."""
    prompt = _chat(tokenizer, "Describe a person as JSON.")
    sp = SamplingParams(max_tokens=120, json_schema=json.dumps(SCHEMA), temperature=1.0,
                        seed=9)
    single, prefill, decode = make_engine(), make_engine(), make_engine()
    want = tokens(run_to_end(single, [GenerateRequest("s", prompt, sp)])["s"])
    req = GenerateRequest("r", prompt, sp)
    prefill.add_request(req, prefill_only=True)
    first = None
    while prefill.has_unfinished():
        for ev in prefill.step():
            first = ev
    alloc = decode.allocate_remote(req)
    skip = alloc.num_cached_tokens // decode.config.block_size
    for s, d in zip(prefill.held_blocks("r")[skip:], alloc.block_ids[skip:], strict=True):
        decode.kv_pool[d].copy_(prefill.kv_pool[s])
    prefill.release("r")
    out = [decode.admit_remote("r", first.token_id)]
    while decode.has_unfinished():
        out.extend(decode.step())
    assert tokens(out) == want
    _check(json.loads(tokenizer.decode(tokens(out))))
