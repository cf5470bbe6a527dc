"""OpenAI sampling parameters on a real 1P1D cluster: penalties, seeds and n > 1 give the
same output whether the prompt was prefilled remotely (KV over UCX) or locally."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.cluster import LocalCluster
from tests.helpers.cluster_util import cluster_fixture

REMOTE_THRESHOLD = 64
TIMINGS = {"X-Pdserve-Timings": "1"}
pytestmark = pytest.mark.timeout(900)


cluster = cluster_fixture(kv_cache_mb=192,
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD)))


@pytest.fixture(scope="module")
def http(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.http_url, timeout=300) as c:
        yield c


def _uncached(ids: list[int], salt: int) -> list[int]:
    out = list(ids)
    out[1] = 2000 + salt
    return out


def _complete(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/completions", json=body, headers=TIMINGS)
    assert r.status_code == 200, r.text
    return r.json()


PARAMS = [
    {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
     "presence_penalty": 0.4, "ignore_eos": True},
    {"temperature": 1.0, "seed": 11, "min_p": 0.05, "repetition_penalty": 1.2,
     "frequency_penalty": 0.3, "min_tokens": 10, "logit_bias": {"29": 2.0}},
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy-penalties", "seeded-penalties"])
def test_remote_and_local_prefill_agree(http: httpx.Client, prompt_ids, params) -> None:  # type: ignore[no-untyped-def]
    ids = _uncached(prompt_ids[-1], len(params))
    body = {"prompt": ids, "max_tokens": 10, **params}
    remote = _complete(http, body)
    assert remote["pdserve"]["route"] == "remote"
    local = _complete(http, body)  # the prompt is now in the decode worker's prefix cache
    assert local["pdserve"]["route"] == "local"
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    assert remote["usage"]["completion_tokens"] == 10


def test_n_children_through_remote_prefill(http: httpx.Client, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    ids = _uncached(prompt_ids[-1], 7)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3,
            "frequency_penalty": 0.5}
    first = _complete(http, body)  # child 0 prefills remotely, 1 and 2 hit the prefix cache
    again = _complete(http, body)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1
    for j in range(3):
        one = _complete(http, {**body, "n": 1, "seed": 5 + j})
        assert one["choices"][0]["text"] == texts[j]


def test_json_schema_through_remote_prefill(http: httpx.Client, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}},
              "required": ["n"], "additionalProperties": False}
    body = {"prompt": _uncached(prompt_ids[-1], 9), "max_tokens": 16, "temperature": 1.0,
            "seed": 2, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "n", "schema": schema}}}
    remote = _complete(http, body)
    assert remote["pdserve"]["route"] == "remote"
    local = _complete(http, body)
    assert local["pdserve"]["route"] == "local"
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    if remote["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(remote["choices"][0]["text"])) == {"n"}
