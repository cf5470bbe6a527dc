"""Overload control (issue 11): the router's admission decision, its error on both APIs, and
a real 1-decode-worker cluster flooded past a small in-flight cap.

The flood asserts outcomes, not timings: every request ends with 200 or an early 429 +
Retry-After (RESOURCE_EXHAUSTED on gRPC), none hangs past its client timeout, none gets a
5xx, and the worker's KV blocks all come back.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli_args import add_admission_args, admission_argv, admission_config_from_args
from pdserve.control.load import WorkerLoad
from pdserve.errors import (
    ERROR_CLASSES,
    CapacityError,
    ErrorKind,
    OverloadedError,
    kind_of,
    rebuild,
)
from pdserve.gateway.errors import from_pdserve
from pdserve.rpc.errors import RETRY_AFTER_KEY, _error_metadata, status_for
from pdserve.types import LatencyClass
from router.admission import (
    AdmissionConfig,
    AdmissionController,
    external_backlog,
    parse_deadlines,
)
from router.cost import CostModel, prefill_capacity
from tests.helpers.cluster_util import cluster_fixture, generate, wait_blocks_free

INT, S, B = LatencyClass.INTERACTIVE, LatencyClass.STANDARD, LatencyClass.BATCH


def _controller(**kw: object) -> AdmissionController:
    cfg = AdmissionConfig(request_overhead_tokens=0, **kw)  # type: ignore[arg-type]
    return AdmissionController(cfg, rate_tokens_per_s=100.0)


# --------------------------------------------------------------------------- the decision


def test_an_idle_router_admits_even_when_the_rate_is_slow() -> None:
    adm = AdmissionController(AdmissionConfig(), rate_tokens_per_s=0.001)
    ticket = adm.decide(INT, 100_000, now=0.0)
    assert ticket.predicted_wait_s == 0 and adm.in_flight == 1 and adm.pending == 1


def test_refuses_a_request_predicted_to_miss_its_deadline() -> None:
    adm = _controller(ttft_deadlines_s={S: 30.0})
    for _ in range(3):  # 1000 tokens at 100 tok/s: 10 s each
        adm.decide(S, 1000, now=0.0)
    adm.decide(S, 1000, now=0.0)  # 30 s ahead: just meets the deadline
    with pytest.raises(OverloadedError) as err:
        adm.decide(S, 1000, now=0.0)  # 40 s ahead
    assert err.value.reason == "deadline" and err.value.latency_class == "standard"
    assert err.value.retry_after_s == 10  # the excess over the deadline
    assert adm.in_flight == 4  # a refusal holds nothing


def test_batch_is_shed_before_interactive() -> None:
    adm = _controller()
    for _ in range(13):  # 130 s of batch work: more than batch waits for
        adm.decide(B, 1000, now=0.0)
    with pytest.raises(OverloadedError):
        adm.decide(B, 1000, now=0.0)
    # The workers serve interactive first: batch work is not ahead of it.
    adm.decide(INT, 500, now=0.0)
    assert adm.predicted_wait_s(INT) == pytest.approx(5.0)
    adm.decide(S, 1000, now=0.0)  # 5 s of interactive work is ahead of it, not the batch
    assert adm.predicted_wait_s(B) == pytest.approx(145.0)


def test_a_routers_own_batch_queued_at_prefill_workers_is_not_ahead_of_interactive() -> None:
    """The batch flood of docs/bench/placement_s63/flood: batch prompts this router sent sit
    in the prefill worker's queue. They are the router's own pending work (by class), so
    the prefill worker's queued tokens count only past what the router has in flight there:
    another router's work. Counted in full they were ahead of every interactive prompt."""
    adm = _controller()  # 100 tokens/s
    for _ in range(12):
        adm.decide(B, 1000, now=0.0)
    own = {"p0": 12 * 1000.0}  # the router's ledger: charged to the prefill worker
    queued = [("p0", 12 * 1000.0), ("p1", 500.0)]  # p1: another router's prompt
    backlog = external_backlog(queued, own)
    assert backlog == 500.0
    adm.decide(INT, 400, now=0.0, external_backlog_tokens=backlog)  # 5 s ahead: admitted
    with pytest.raises(OverloadedError):  # the queue counted in full: 129 s ahead
        adm.decide(INT, 400, now=0.0, external_backlog_tokens=external_backlog(queued, {}))
    # A heartbeat older than the ledger (the queue drained since) counts nothing negative.
    assert external_backlog([("p0", 100.0)], {"p0": 1100.0}) == 0.0


def test_in_flight_cap_fills_batch_first() -> None:
    adm = _controller(max_in_flight=4)  # batch may hold 3, standard 3, interactive 4
    tickets = [adm.decide(B, 1, now=0.0) for _ in range(3)]
    for cls in (B, S):
        with pytest.raises(OverloadedError) as err:
            adm.decide(cls, 1, now=0.0)
        assert err.value.reason == "in_flight_cap" and err.value.retry_after_s >= 1
    last = adm.decide(INT, 1, now=0.0)
    with pytest.raises(OverloadedError):
        adm.decide(INT, 1, now=0.0)
    for t in [*tickets, last]:
        adm.release(t)
        adm.release(t)  # idempotent
    assert adm.in_flight == 0 and adm.pending == 0 and adm.pending_work == 0


def test_first_tokens_calibrate_the_rate() -> None:
    adm = _controller(rate_ewma_alpha=1.0)
    first = adm.decide(S, 200, now=0.0)
    second = adm.decide(S, 200, now=0.0)  # 200 tokens ahead
    adm.first_token(first, now=1.0)
    assert adm.rate_tokens_per_s == pytest.approx(200.0)
    adm.first_token(second, now=4.0)  # (200 ahead + 200 own) / 4 s
    assert adm.rate_tokens_per_s == pytest.approx(100.0)
    assert adm.pending == 0 and adm.in_flight == 2  # streaming, no longer waiting
    adm.first_token(second, now=9.0)  # once only
    assert adm.rate_tokens_per_s == pytest.approx(100.0)
    adm.release(first)
    adm.release(second)
    assert adm.in_flight == 0


def test_a_cold_cluster_admits_what_its_measured_capacity_serves_in_time() -> None:
    """No samples yet: the rate is the workers' prefill capacity as placement's cost model
    predicts it (router.cost.prefill_capacity; priors where a worker measured nothing), not
    an optimistic constant. A burst of 64 standard ~500-token prompts at 500 tokens/s admits
    the 27 whose predicted wait fits the 30 s deadline."""
    adm = AdmissionController(AdmissionConfig())
    cold = [WorkerLoad(), WorkerLoad()]  # a prefill and a decode worker, nothing measured
    capacity = prefill_capacity(cold, CostModel())
    assert capacity == 2 * CostModel().prior_prefill_tokens_per_s == 500.0
    admitted, refused = [], 0
    for _ in range(64):
        try:
            admitted.append(adm.decide(S, 500, now=0.0, capacity_tokens_per_s=capacity))
        except OverloadedError as exc:
            assert exc.reason == "deadline"
            refused += 1
    assert len(admitted) == 27 and refused == 37  # 26 x 564 tokens ahead <= 30 s x 500/s
    assert max(t.predicted_wait_s for t in admitted) <= 30.0
    # Measured rates replace the priors at the next heartbeat: more fits.
    warm = [WorkerLoad(prefill_tokens_per_s=1200.0), WorkerLoad(prefill_tokens_per_s=800.0)]
    adm.decide(S, 500, now=0.0, capacity_tokens_per_s=prefill_capacity(warm, CostModel()))

    # From min_samples first tokens on, the observed rate decides: an average that started
    # from the capacity (2,000 tokens/s) and moves by alpha (0.2) per sample.
    for t in admitted[: adm.config.min_samples]:
        assert adm.rate == 2000.0  # still the capacity
        adm.first_token(t, now=(t.ahead + t.work) / 700.0)  # observed: 700 tokens/s
    assert adm.samples == adm.config.min_samples
    expected = 700.0 + (2000.0 - 700.0) * 0.8 ** 4
    assert adm.rate == adm.rate_tokens_per_s == pytest.approx(expected)


def test_disabled_admits_everything() -> None:
    adm = _controller(enabled=False, max_in_flight=1)
    for _ in range(10):
        adm.decide(B, 100_000, now=0.0)
    assert adm.in_flight == 10


def test_config_validation_and_deadline_flags() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_in_flight=0)
    with pytest.raises(ValueError):
        AdmissionConfig(ttft_deadlines_s={INT: 0.0})
    cfg = AdmissionConfig(ttft_deadlines_s={INT: 2.0})
    assert cfg.deadline_s(INT) == 2.0 and cfg.deadline_s(B) == 120.0  # the rest keep defaults
    assert parse_deadlines(["interactive=2", "batch=60.5"]) == {INT: 2.0, B: 60.5}
    for bad in ("fast=2", "interactive", "interactive=-1", "standard=nan"):
        with pytest.raises(ValueError):
            parse_deadlines([bad])

    p = argparse.ArgumentParser()
    add_admission_args(p)
    args = p.parse_args(["--max-in-flight", "8", "--ttft-deadline", "standard=5"])
    cfg = admission_config_from_args(args)
    assert cfg.enabled and cfg.max_in_flight == 8 and cfg.deadline_s(S) == 5.0
    assert p.parse_args(admission_argv(args)) == args
    assert not admission_config_from_args(p.parse_args(["--no-admission"])).enabled
    assert cfg.first_token_deadline_factor == 4.0  # late answers may finish, up to 4x
    relaxed = p.parse_args(["--deadline-factor", "1"])  # answered in time or refused
    assert admission_config_from_args(relaxed).first_token_deadline_factor == 1.0
    assert p.parse_args(admission_argv(relaxed)) == relaxed
    for bad in ("0", "-1", "inf", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--deadline-factor", bad])


# --------------------------------------------------------------------------- the error


def test_overloaded_is_429_with_retry_after_and_resource_exhausted() -> None:
    exc = OverloadedError("busy", reason="deadline", latency_class="batch", retry_after_s=7)
    assert kind_of(exc) is ErrorKind.RESOURCE_EXHAUSTED
    api = from_pdserve(exc, retry_after_s=1)
    assert api.status == 429 and api.headers["Retry-After"] == "7"
    assert api.body()["error"]["code"] == "overloaded"
    assert api.body()["error"]["type"] == "rate_limit_error"
    assert status_for(exc)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (RETRY_AFTER_KEY, "7") in _error_metadata(exc, None)
    # A gRPC client rebuilds it from the code; it is still a CapacityError to older callers.
    assert ERROR_CLASSES["overloaded"] is OverloadedError
    rebuilt = rebuild(ErrorKind.UNAVAILABLE, "overloaded", "busy")
    assert isinstance(rebuilt, OverloadedError) and isinstance(rebuilt, CapacityError)


# --------------------------------------------------------------------------- a real cluster

MAX_IN_FLIGHT = 3
WORKER_MAX_REQUESTS = 4  # above the router's cap: only direct callers reach it
FLOOD_HTTP = 16
FLOOD_GRPC = 6
CLIENT_TIMEOUT_S = 240  # "no hang": far below the old 120 s x retries, far above a real run


cluster = cluster_fixture(prefill=0, kv_cache_mb=96,
                          worker_args=("--max-requests", str(WORKER_MAX_REQUESTS)),
                          router_args=("--max-in-flight", str(MAX_IN_FLIGHT),
                                       "--ttft-deadline", "interactive=5",
                                       "--ttft-deadline", "standard=10",
                                       "--ttft-deadline", "batch=20"))


async def _http(client: httpx.AsyncClient, model: str, i: int) -> httpx.Response:
    cls = ("interactive", "standard", "batch")[i % 3]
    return await client.post("/v1/completions", headers={"X-Latency-Class": cls}, json={
        "model": model, "prompt": f"Request {i}: count from one to ten.", "max_tokens": 24,
        "temperature": 0})


async def _grpc(address: str, ids: list[int], i: int) -> str:
    try:
        await generate(address, ids, max_tokens=24, deadline_s=CLIENT_TIMEOUT_S,
                       latency=("interactive", "standard", "batch")[i % 3])
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


@pytest.mark.timeout(900)
async def test_flood_gets_200_or_early_429_and_leaks_nothing(cluster, tokenizer) -> None:
    ids = tokenizer.encode("Count from one to ten, slowly.")
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=CLIENT_TIMEOUT_S) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        http_calls = [_http(client, model, i) for i in range(FLOOD_HTTP)]
        grpc_calls = [_grpc(cluster.grpc_address, ids, i) for i in range(FLOOD_GRPC)]
        results = await asyncio.gather(*http_calls, *grpc_calls, return_exceptions=True)
        metrics = (await client.get("/metrics")).text
    hangs = [r for r in results if isinstance(r, BaseException)]
    assert not hangs, hangs  # a client timeout would show here
    http = results[:FLOOD_HTTP]
    codes = sorted(r.status_code for r in http)  # type: ignore[union-attr]
    # Answered within the class's deadline, refused early (429), or, admitted but past the
    # deadline after all (the prediction was wrong), ended at the deadline with a 503.
    assert set(codes) <= {200, 429, 503}, codes
    grpc_codes = results[FLOOD_HTTP:]
    # Which API wins the first slots is a race (the gRPC calls may take all three before the
    # HTTP ones arrive): the flood as a whole must see both an answer and an early refusal.
    answered = codes.count(200) + grpc_codes.count("OK")
    refused = codes.count(429) + grpc_codes.count("RESOURCE_EXHAUSTED")
    assert answered >= 1 and refused >= 1, (codes, grpc_codes)
    print(f"flood: HTTP {codes.count(200)} x 200, {codes.count(429)} x 429, "
          f"{codes.count(503)} x 503; gRPC {grpc_codes.count('OK')} OK, "
          f"{grpc_codes.count('RESOURCE_EXHAUSTED')} RESOURCE_EXHAUSTED, "
          f"{grpc_codes.count('UNAVAILABLE')} UNAVAILABLE")
    for r in http:
        if r.status_code in (429, 503):  # type: ignore[union-attr]
            assert int(r.headers["Retry-After"]) >= 1  # type: ignore[union-attr]
        if r.status_code == 429:  # type: ignore[union-attr]
            assert r.json()["error"]["code"] == "overloaded"  # type: ignore[union-attr]
    assert set(grpc_codes) <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, grpc_codes

    rejected = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == "pdserve_router_rejections_total")
    assert rejected == refused
    in_flight = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "pdserve_router_in_flight"]
    assert in_flight == [0.0]

    free, total = await wait_blocks_free(f"127.0.0.1:{cluster.ports['decode-0']}", "decode",
                                         timeout_s=30)
    assert free == total > 0


@pytest.mark.timeout(600)
async def test_decode_worker_bounds_what_it_holds(cluster, tokenizer) -> None:
    """Callers that bypass the router (or several routers) meet the worker's own bound: past
    --max-requests a request is refused at once with UNAVAILABLE / worker_full, the others
    finish, nothing leaks."""
    from pdserve.rpc import transport
    from pdserve.rpc.errors import ERROR_CODE_KEY
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    ids = tokenizer.encode("Name three rivers.")
    address = f"127.0.0.1:{cluster.ports['decode-0']}"

    async def one(stub: decode_pb2_grpc.DecodeWorkerStub, i: int) -> str:
        req = decode_pb2.DecodeGenerateRequest(input=common_pb2.GenerateInput(
            request_id=f"direct-{i}", prompt_token_ids=ids,
            sampling=common_pb2.SamplingParams(max_tokens=16)))
        try:
            async for _ in stub.Generate(req, timeout=CLIENT_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as exc:
            codes = [v for k, v in (exc.trailing_metadata() or ()) if k == ERROR_CODE_KEY]
            return f"{exc.code().name}:{codes[0] if codes else ''}"
        return "OK"

    async with transport.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)
        results = await asyncio.gather(*(one(stub, i) for i in range(3 * WORKER_MAX_REQUESTS)))
    print("direct flood:", sorted(results))
    assert set(results) <= {"OK", "UNAVAILABLE:worker_full"}, results
    assert results.count("OK") >= WORKER_MAX_REQUESTS
    assert "UNAVAILABLE:worker_full" in results
    free, total = await wait_blocks_free(address, "decode", timeout_s=30)
    assert free == total > 0
