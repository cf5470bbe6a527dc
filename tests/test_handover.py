"""The first token's one channel: the KV transfer's completion notice (pdserve.handover)."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import KVTransferError
from pdserve.handover import FirstToken
from pdserve.types import TokenLogprob


@pytest.mark.parametrize("first", [
    FirstToken(0),  # token id 0 is a real token
    FirstToken(7, TokenLogprob(7, -0.25)),
    FirstToken(7, TokenLogprob(7, -0.25, ((7, -0.25), (9, -2.0), (3, float("-inf"))))),
])
def test_round_trip_through_json_keeps_top_logprobs(first: FirstToken) -> None:
    wire = json.loads(json.dumps(first.to_notice()))  # kvxfer sends the notice as JSON
    assert FirstToken.from_notice(wire) == first


@pytest.mark.parametrize("notice", [
    None, {}, {"first_token": -1}, {"first_token": True}, {"first_token": "7"},
    {"first_token": 7, "logprob": "x"}, {"first_token": 7, "logprob": -1.0, "top": [[1]]},
    {"first_token": 7, "logprob": float("nan")},
])
def test_malformed_notices_are_protocol_errors(notice: object) -> None:
    with pytest.raises(KVTransferError) as info:
        FirstToken.from_notice(notice)  # type: ignore[arg-type]
    assert info.value.code == "kv_protocol"
