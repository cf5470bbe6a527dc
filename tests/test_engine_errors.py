"""Bad input is refused with a typed error and a stable code; the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import InvalidRequestError, PdserveError, PromptTooLongError
from pdserve.types import GenerateRequest, LatencyClass, SamplingParams
from tests.helpers.engine_util import greedy, run_to_end, tokens


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens-0"),
        pytest.param({"max_tokens": -3}, "max_tokens", id="max_tokens-negative"),
        pytest.param({"max_tokens": 2.5}, "max_tokens", id="max_tokens-float"),
        pytest.param({"max_tokens": True}, "max_tokens", id="max_tokens-bool"),
        pytest.param({"temperature": -0.5}, "temperature", id="temperature-negative"),
        pytest.param({"temperature": math.nan}, "temperature", id="temperature-nan"),
        pytest.param({"temperature": math.inf}, "temperature", id="temperature-inf"),
        pytest.param({"temperature": "hot"}, "temperature", id="temperature-str"),
        pytest.param({"top_p": 0.0}, "top_p", id="top_p-0"),
        pytest.param({"top_p": 1.5}, "top_p", id="top_p-1.5"),
        pytest.param({"top_p": math.nan}, "top_p", id="top_p-nan"),
        pytest.param({"top_k": -1}, "top_k", id="top_k-negative"),
        pytest.param({"top_k": 2.0}, "top_k", id="top_k-float"),
        pytest.param({"logprobs": 100}, "logprobs", id="logprobs-100"),
        pytest.param({"logprobs": -1}, "logprobs", id="logprobs-negative"),
        pytest.param({"seed": "42"}, "seed", id="seed-str"),
        pytest.param({"stop": 5}, "stop", id="stop-int"),
        pytest.param({"stop": "END"}, "stop", id="stop-bare-string"),
        pytest.param({"stop": [1]}, "stop", id="stop-list-of-int"),
        pytest.param({"stop": [""]}, "stop", id="stop-empty-string"),
        pytest.param({"stop_token_ids": [-1]}, "stop_token_ids", id="stop_token_ids-negative"),
        pytest.param({"stop_token_ids": ["2"]}, "stop_token_ids", id="stop_token_ids-str"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.code == "invalid_sampling_params"
    assert info.value.param == param
    assert param.replace("_", " ") in info.value.message.replace("_", " ")


def test_valid_edge_sampling_params() -> None:
    sp = SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, logprobs=20,
                        stop=["a", "b"], stop_token_ids=[0])
    assert sp.greedy and sp.stop == ("a", "b") and sp.stop_token_ids == (0,)


def test_empty_prompt_and_request_id() -> None:
    with pytest.raises(InvalidRequestError) as info:
        GenerateRequest("x", ())
    assert info.value.code == "empty_prompt" and info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="request_id"):
        GenerateRequest("", (1, 2))


def test_unknown_latency_class() -> None:
    with pytest.raises(InvalidRequestError) as info:
        LatencyClass.parse("urgent")
    assert info.value.code == "invalid_latency_class"
    assert "interactive" in info.value.message and "'urgent'" in info.value.message
    assert LatencyClass.parse(None) is LatencyClass.STANDARD
    assert LatencyClass.parse(" Interactive ") is LatencyClass.INTERACTIVE


def test_engine_rejects_bad_requests_and_keeps_serving(make_engine, tokenizer) -> None:
    engine = make_engine(max_model_len=64)
    free = engine.block_manager.num_free_blocks
    vocab = engine.model_config.vocab_size
    ok = tuple(tokenizer.encode("The capital of France is"))

    with pytest.raises(PromptTooLongError) as too_long:
        engine.add_request(GenerateRequest("long", (1,) * 64, greedy()))
    assert too_long.value.code == "context_length_exceeded" and "64" in too_long.value.message
    for bad in (vocab, -1, 10**12):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            engine.add_request(GenerateRequest(f"tok{bad}", (*ok, bad), greedy()))
    for bad in (1.5, "7", None, True):
        with pytest.raises(InvalidRequestError, match="token id"):
            engine.add_request(GenerateRequest("type", (*ok, bad), greedy()))  # type: ignore[arg-type]

    engine.add_request(GenerateRequest("dup", ok, greedy(4)))
    with pytest.raises(InvalidRequestError, match="duplicate request id") as dup:
        engine.add_request(GenerateRequest("dup", ok, greedy(4)))
    assert dup.value.param == "request_id"
    with pytest.raises(InvalidRequestError, match="not awaiting KV"):
        engine.admit_remote("dup", 1)
    with pytest.raises(InvalidRequestError, match="not awaiting KV"):
        engine.admit_remote("never-seen", 1)
    assert engine.abort("never-seen") is None
    engine.release("never-seen")  # releasing something unknown is a no-op

    # The first "dup" is unaffected by the refused duplicate; a canary after it also works.
    first = [ev for _ in range(10) for ev in engine.step()]
    assert len(tokens(first)) == 4 and first[-1].finish_reason == "length"
    out = run_to_end(engine, [GenerateRequest("canary", ok, greedy(4))])
    assert tokens(out["canary"]) == tokens(first)
    assert engine.block_manager.num_free_blocks == free
    st = engine.stats()
    assert (st.running, st.waiting, st.awaiting_kv, st.held) == (0, 0, 0, 0)


def test_prompt_larger_than_kv_pool(make_engine) -> None:
    engine = make_engine(num_kv_blocks=4)  # 64 tokens of KV in all
    with pytest.raises(PromptTooLongError, match="KV cache"):
        engine.add_request(GenerateRequest("big", (1,) * 64, greedy()))
    with pytest.raises(PromptTooLongError):
        engine.allocate_remote(GenerateRequest("big-remote", (1,) * 64, greedy()))
    assert engine.block_manager.num_free_blocks == 4
    # Growth past the pool during decoding ends the request with "length", not an error.
    out = run_to_end(engine, [GenerateRequest("grow", (1,) * 60, greedy(16))])
    assert out["grow"][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 4


def test_remote_allocation_without_capacity(make_engine) -> None:
    from pdserve.errors import CapacityError

    engine = make_engine(num_kv_blocks=4)
    engine.allocate_remote(GenerateRequest("a", (1,) * 40, greedy()))  # 3 of 4 blocks
    with pytest.raises(CapacityError) as info:
        engine.allocate_remote(GenerateRequest("b", (2,) * 40, greedy()))
    assert info.value.code == "no_capacity"
    # The refused request left nothing behind: its id may be used again.
    engine.abort("a")
    engine.allocate_remote(GenerateRequest("b", (2,) * 40, greedy()))
    engine.abort("b")


def test_every_error_is_a_pdserve_error() -> None:
    for exc in (InvalidRequestError, PromptTooLongError):
        assert issubclass(exc, PdserveError)
