"""bench.loadgen against a known case: a real uvicorn SSE server on loopback whose delays and
token counts are set by the test, plus exact checks of the pure metric functions."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.loadgen import (
    SLO,
    ConfigError,
    LengthDist,
    NonLocalTargetError,
    RequestResult,
    RunConfig,
    compare,
    goodput,
    named_workload,
    run_load,
    runner,
    summarize,
    sweep,
    write_sweep,
)
from bench.loadgen.arrivals import arrival_times
from bench.loadgen.cli import main as cli_main
from bench.loadgen.metrics import steady_output_throughput
from bench.loadgen.prompts import load_tokenizer, synthetic_prompt
from bench.loadgen.workload import build_requests, custom_workload

REPO_ROOT = Path(__file__).resolve().parents[1]
TTFT_S = 0.100
ITL_S = 0.020
OUTPUT_TOKENS = 8
PROMPT_TOKENS = 32
WORKLOAD = custom_workload(
    LengthDist("fixed", PROMPT_TOKENS), LengthDist("fixed", OUTPUT_TOKENS), "interactive"
)
LOOSE_SLO = SLO(ttft_ms=5000, tpot_ms=5000)


def _near(measured_ms: float, expected_ms: float) -> bool:
    """No timing assertion: the fake server sleeps `expected_ms`, so less cannot be measured
    (a little slack for timer granularity), and on a loaded machine much more can. The upper
    bound only catches a unit slip (seconds for milliseconds: 1,000x)."""
    return expected_ms * 0.9 <= measured_ms <= expected_ms * 20 + 1000


# --------------------------------------------------------------------------- fake server


@dataclass
class Behaviour:
    """How the fake server answers its n-th request (counted from 0 on arrival)."""

    ttft_s: float = TTFT_S
    itl_s: float = ITL_S
    send_usage: bool = True
    failures: dict[int, str] = field(default_factory=dict)  # n % len(cycle) -> failure kind
    cycle: int = 1
    received: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def make_app(behaviour: Behaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        n = len(behaviour.received)
        behaviour.received.append((dict(request.headers), body))
        failure = behaviour.failures.get(n % behaviour.cycle)
        if failure in ("500", "400"):
            error = {"message": f"injected {failure}", "type": "test", "code": "injected"}
            return JSONResponse({"error": error}, status_code=int(failure))
        if failure == "429":  # an admission refusal, as pdserve's router answers it
            error = {"message": "overloaded", "type": "rate_limit_error", "code": "overloaded"}
            return JSONResponse({"error": error}, status_code=429, headers={"Retry-After": "7"})
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        num_tokens = int(body["max_tokens"])

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            return {"id": "x", "model": "fake-model", "choices": [choice]}

        async def events() -> AsyncIterator[bytes]:
            if chat:  # OpenAI sends the role first, with no content: not a token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(behaviour.ttft_s)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(behaviour.itl_s)
                if failure == "stream" and i == 2:
                    yield _sse({"error": {"message": "injected stream failure"}})
                    return
                if failure == "truncate" and i == 2:
                    return  # connection closes cleanly but without [DONE]
                yield _sse(chunk(f" t{i}", "length" if i == num_tokens - 1 else None))
            if behaviour.send_usage:
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens}
                yield _sse({"id": "x", "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


@asynccontextmanager
async def serve(behaviour: Behaviour) -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(behaviour), lifespan="off", log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


# --------------------------------------------------------------------------- against a server


async def test_measures_known_latencies_and_counts() -> None:
    behaviour = Behaviour()
    async with serve(behaviour) as url:
        config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=8,
            concurrency=4,
            slo=LOOSE_SLO,
            max_duration_s=60,
        )
        result = await run_load(config)

    assert result.model == "fake-model"
    assert len(result.requests) == 8
    for r in result.requests:
        assert r.ok, r.error
        assert r.output_tokens == OUTPUT_TOKENS
        assert r.prompt_tokens == PROMPT_TOKENS
        assert len(r.itl_s) == OUTPUT_TOKENS - 1
        assert r.latency_class == "interactive"
    s = result.summary
    assert s.overall.num_errors == 0 and s.num_unsent == 0
    assert s.overall.ttft_ms is not None and _near(s.overall.ttft_ms.p50, TTFT_S * 1000)
    assert s.overall.tpot_ms is not None and _near(s.overall.tpot_ms.p50, ITL_S * 1000)
    assert s.overall.itl_ms is not None and _near(s.overall.itl_ms.p50, ITL_S * 1000)
    expected_e2e_ms = (TTFT_S + (OUTPUT_TOKENS - 1) * ITL_S) * 1000
    assert s.overall.e2e_ms is not None and _near(s.overall.e2e_ms.p50, expected_e2e_ms)
    assert s.overall.attainment.both == 1.0
    assert set(s.by_class) == {"interactive"}
    assert s.output_token_throughput == pytest.approx(8 * OUTPUT_TOKENS / s.duration_s)
    assert s.request_throughput == pytest.approx(8 / s.duration_s)

    headers, body = behaviour.received[0]
    assert headers["x-latency-class"] == "interactive"
    assert body["stream"] is True and body["max_tokens"] == OUTPUT_TOKENS
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"
    assert "ignore_eos" not in body


async def test_tight_slo_is_missed() -> None:
    async with serve(Behaviour()) as url:
        config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=4,
            concurrency=4,
            slo=SLO(ttft_ms=5000, tpot_ms=5),
            max_duration_s=60,
        )
        result = await run_load(config)
    attainment = result.summary.overall.attainment
    assert (attainment.both, attainment.ttft_only, attainment.tpot_only) == (0.0, 1.0, 0.0)


async def test_chat_api_role_chunk_is_not_the_first_token() -> None:
    behaviour = Behaviour()
    async with serve(behaviour) as url:
        config = RunConfig(
            url=url,
            api="chat",
            model="m",
            workload=WORKLOAD,
            num_requests=3,
            concurrency=3,
            ignore_eos=True,
            extra_body={"top_k": 5},
            slo=LOOSE_SLO,
            max_duration_s=60,
        )
        result = await run_load(config)
    assert all(r.ok and r.output_tokens == OUTPUT_TOKENS for r in result.requests)
    ttft = result.summary.overall.ttft_ms
    assert ttft is not None and _near(ttft.p50, TTFT_S * 1000)
    _, body = behaviour.received[0]
    assert body["messages"][0]["role"] == "user" and body["model"] == "m"
    assert body["ignore_eos"] is True and body["top_k"] == 5


async def test_errors_are_counted_and_miss_the_slo() -> None:
    behaviour = Behaviour(failures={0: "500", 1: "400", 2: "stream", 3: "truncate"}, cycle=5)
    async with serve(behaviour) as url:
        config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=15,
            concurrency=3,
            slo=LOOSE_SLO,
            max_duration_s=60,
        )
        result = await run_load(config)
    s = result.summary
    assert s.num_sent == 15
    assert s.overall.num_errors == 12 and s.overall.num_ok == 3
    assert s.overall.attainment.both == pytest.approx(3 / 15)
    errors = [r.error or "" for r in result.requests if not r.ok]
    assert sum(e.startswith("HTTP 500: injected 500") for e in errors) == 3
    assert sum(e.startswith("HTTP 400: injected 400") for e in errors) == 3
    assert sum("injected stream failure" in e for e in errors) == 3
    assert sum("[DONE]" in e for e in errors) == 3
    assert [r.status for r in result.requests].count(500) == 3
    assert s.output_token_throughput == pytest.approx(3 * OUTPUT_TOKENS / s.duration_s)


async def test_refusals_keep_their_status_and_retry_after() -> None:
    from bench.admission import outcome, summarize_run

    behaviour = Behaviour(failures={0: "429", 1: "500"}, cycle=3)
    async with serve(behaviour) as url:
        config = RunConfig(url=url, workload=WORKLOAD, num_requests=6, concurrency=2,
                           slo=LOOSE_SLO, max_duration_s=60, max_retry_after_s=0)
        result = await run_load(config)
    refused = [r for r in result.requests if r.status == 429]
    assert len(refused) == 2 and all(r.retry_after_s == 7.0 for r in refused)
    assert all(r.retry_after_s is None for r in result.requests if r.status != 429)
    assert sorted(outcome(r) for r in result.requests) == ["completed"] * 2 + ["error"] * 2 \
        + ["rejected"] * 2
    s = summarize_run(result)
    assert (s["completed"], s["rejected"], s["rejected_with_retry_after"], s["errors"],
            s["hangs"], s["good"]) == (2, 2, 2, 2, 0, 2)


async def test_a_closed_loop_waits_out_a_refusals_retry_after() -> None:
    """A worker refused with Retry-After sends its next request once the wait is over (capped
    by max_retry_after_s), as a real client does; not at once, which on a server shedding
    load spends the run's requests on refusals in a second."""
    behaviour = Behaviour(failures={0: "429"}, cycle=100)  # the first request only
    async with serve(behaviour) as url:
        config = RunConfig(url=url, workload=WORKLOAD, num_requests=2, concurrency=1,
                           slo=LOOSE_SLO, max_duration_s=60, max_retry_after_s=0.5)
        result = await run_load(config)
    refused, served = sorted(result.requests, key=lambda r: r.start_s)
    assert refused.status == 429 and refused.retry_after_s == 7.0 and served.ok
    assert refused.e2e_s is not None
    gap = served.start_s - (refused.start_s + refused.e2e_s)
    assert gap >= 0.5 * 0.9  # slept (the cap: the header's 7 s would only slow the test)


async def test_without_usage_output_tokens_are_counted_from_chunks() -> None:
    async with serve(Behaviour(send_usage=False)) as url:
        config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=2,
            concurrency=2,
            slo=LOOSE_SLO,
            max_duration_s=60,
        )
        result = await run_load(config)
    assert [r.output_tokens for r in result.requests] == [OUTPUT_TOKENS] * 2
    assert [r.prompt_tokens for r in result.requests] == [PROMPT_TOKENS] * 2  # the target


async def test_max_duration_bounds_every_run() -> None:
    slow = Behaviour(ttft_s=0.05, itl_s=0.2)
    long_output = custom_workload(LengthDist("fixed", 16), LengthDist("fixed", 50))
    async with serve(slow) as url:
        begin = time.perf_counter()
        closed = await run_load(
            RunConfig(
                url=url, workload=long_output, num_requests=3, concurrency=3, max_duration_s=0.6
            )
        )
        assert time.perf_counter() - begin < 3.0
        assert closed.summary.overall.num_errors == 3
        assert all("max_duration_s" in (r.error or "") for r in closed.requests)

        open_config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=10,
            rate=1.0,
            seed=3,
            max_duration_s=1.5,
            slo=LOOSE_SLO,
        )
        begin = time.perf_counter()
        opened = await run_load(replace(open_config, model="fake-model"))
        assert time.perf_counter() - begin < 4.0
    expected_sent = int((arrival_times(10, 1.0, 1.0, seed=3) < 1.5).sum())
    assert opened.summary.num_sent == expected_sent
    assert opened.summary.num_unsent == 10 - expected_sent


async def test_sweep_writes_results_and_plots(tmp_path: Path) -> None:
    async with serve(Behaviour()) as url:
        config = RunConfig(
            url=url,
            workload=WORKLOAD,
            num_requests=4,
            slo=LOOSE_SLO,
            max_duration_s=60,
            warmup_requests=1,
        )
        result = await sweep(config, [20.0, 5.0], label="fake")
    assert result.rates == [5.0, 20.0]
    assert result.goodput.rate == 20.0 and not result.goodput.bounded
    written = write_sweep(tmp_path, result)
    names = {p.name for p in written}
    expected = {"rate_5.json", "rate_20.json", "summary.json", "slo_attainment.png", "latency.png"}
    assert names == expected
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["goodput"]["rate"] == 20.0 and len(summary["runs"]) == 2
    per_rate = json.loads((tmp_path / "rate_5.json").read_text())
    assert len(per_rate["requests"]) == 4 and per_rate["requests"][0]["ok"] is True
    assert (tmp_path / "latency.png").read_bytes()[:4] == b"\x89PNG"
    table = compare({"a": result, "b": result})
    assert "| a | 20 | 20 (not reached: sweep higher) | 1.00x |" in table


async def test_goodput_calibration_keeps_every_unloaded_request(tmp_path: Path) -> None:
    """bench.goodput's unloaded probes: the table in comparison.md (the simulator reads it)
    and each request as measured in <system>/unloaded.json."""
    from bench.goodput import calibrate, write_comparison

    async with serve(Behaviour()) as url:
        config = RunConfig(url=url, workload=WORKLOAD, num_requests=4, slo=LOOSE_SLO,
                           max_duration_s=60, model="fake-model")
        unloaded = await calibrate(config, 3)
        result = await sweep(config, [20.0], label="fake")
    assert [len(u.requests) for u in unloaded] == [3] and unloaded[0].n == 3
    table = write_comparison({"fake": result}, tmp_path, unloaded={"fake": unloaded})
    assert "Unloaded (one request at a time)" in table
    kept = json.loads((tmp_path / "fake" / "unloaded.json").read_text())
    (name, rows), = kept.items()
    assert name == unloaded[0].request_class and len(rows) == 3
    assert all(r["ttft_s"] > 0 and r["error"] is None and r["route"] is None for r in rows)


async def test_a_sweep_raises_the_rate_until_the_slo_breaks() -> None:
    """With `raise_until_below`, a system that still meets its SLOs at the highest planned
    rate is run again at 1.5x, so the sweep ranks it; never more than the runs allowed."""
    async with serve(Behaviour()) as url:
        config = RunConfig(url=url, workload=WORKLOAD, num_requests=3, slo=LOOSE_SLO,
                           max_duration_s=60)
        loose = await sweep(config, [4.0], raise_until_below=2)
        assert loose.rates == [4.0, 6.0, 9.0]
        strict = replace(config, slo=replace(LOOSE_SLO, ttft_ms=0.001))
        broken = await sweep(strict, [4.0], raise_until_below=2)
        assert broken.rates == [4.0] and broken.goodput.rate is None


async def test_a_sweep_lowers_the_rate_only_while_that_helps() -> None:
    """With `lower_until_met`, a system that meets its SLOs at no planned rate is run again
    lower; when the lower rate does not raise the attainment (here: an unloaded TTFT above the
    bound), the sweep stops there instead of spending the allowed runs."""
    async with serve(Behaviour()) as url:
        config = RunConfig(url=url, workload=WORKLOAD, num_requests=3, max_duration_s=60,
                           slo=replace(LOOSE_SLO, ttft_ms=0.001))  # fmt: skip
        never = await sweep(config, [6.0, 9.0], lower_until_met=3)
        assert never.rates == [4.0, 6.0, 9.0]  # ascending, whatever order they ran in
        assert never.goodput.rate is None
        assert "| never | none | none (below 90% down to 4 req/s: sweep lower) |" in compare(
            {"never": never})
        loose = await sweep(replace(config, slo=LOOSE_SLO), [6.0], lower_until_met=3)
        assert loose.rates == [6.0]


def _ran(rate: float, attainment: float) -> Any:
    """What `runner._rates` reads of a run: its rate and its SLO attainment."""
    both = SimpleNamespace(both=attainment)
    summary = SimpleNamespace(overall=SimpleNamespace(attainment=both))
    return SimpleNamespace(config=SimpleNamespace(rate=rate), summary=summary)


@pytest.mark.parametrize(
    ("attainments", "raise_n", "lower_n", "expected"),
    [
        # every rate above 90 %: raised at 1.5x until one breaks, never lowered
        ({1.0: 1.0, 2.0: 0.95, 3.0: 0.92, 4.5: 0.5}, 4, 2, [1.0, 2.0, 3.0, 4.5]),
        # none meets it: lowered while each step helps, until one meets it
        ({1.0: 0.5, 2.0: 0.1, 0.667: 0.8, 0.445: 0.95}, 4, 3, [1.0, 2.0, 0.667, 0.445]),
        # a step down that does not help ends it
        ({1.0: 0.5, 2.0: 0.1, 0.667: 0.5}, 4, 3, [1.0, 2.0, 0.667]),
        # never more than allowed
        ({1.0: 0.5, 0.667: 0.6, 0.445: 0.7}, 0, 2, [1.0, 0.667, 0.445]),
        # lowering off
        ({1.0: 0.3}, 4, 0, [1.0]),
    ],
)
def test_the_rates_a_sweep_runs(attainments: dict[float, float], raise_n: int, lower_n: int,
                                expected: list[float]) -> None:  # fmt: skip
    runs: list[Any] = []
    planned = [r for r in (1.0, 2.0) if r in attainments]
    for rate in runner._rates(planned, runs, 0.9, raise_n, lower_n, 1.5):
        runs.append(_ran(rate, attainments[rate]))
    assert [run.config.rate for run in runs] == expected


async def test_cli_sweep(tmp_path: Path) -> None:
    async with serve(Behaviour()) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.loadgen",
            "sweep",
            "--url",
            url,
            "--rates",
            "4,8",
            "--num-requests",
            "3",
            "--prompt-len",
            "fixed:16",
            "--output-len",
            "fixed:4",
            "--out",
            str(tmp_path),
            "--quiet",
            "--ttft-slo-ms",
            "5000",
            "--raise-rates",
            "1",
            "--min-rate-seconds",
            "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=REPO_ROOT,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    # the per-rate table says what each rate sent (held 1 s: 8 at 8 req/s, not 3)
    assert "| 8 | system | 8 | 100.0% |" in out.decode()
    summary = json.loads((tmp_path / "summary.json").read_text())
    # raised once to 12; each rate held >= 1 s: 4 and 8 requests, then 12 (over --num-requests 3)
    assert [len(json.loads((tmp_path / f"rate_{r}.json").read_text())["requests"])
            for r in (4, 8, 12)] == [4, 8, 12] and len(summary["runs"]) == 3  # fmt: skip
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "slo_attainment.png").is_file()


# --------------------------------------------------------------------------- pure functions


def _result(
    ttft_ms: float | None,
    tpot_ms: float,
    tokens: int = 11,
    error: str | None = None,
    latency_class: str = "interactive",
) -> RequestResult:
    ttft = None if ttft_ms is None else ttft_ms / 1000
    e2e = None if ttft is None else ttft + tpot_ms / 1000 * (tokens - 1)
    return RequestResult(
        index=0,
        latency_class=latency_class,
        prompt_tokens=10,
        max_tokens=tokens,
        output_tokens=tokens,
        start_s=0.0,
        ttft_s=ttft,
        e2e_s=e2e,
        error=error,
    )


def test_attainment_and_goodput_exact() -> None:
    slo = SLO(ttft_ms=200, tpot_ms=50, target=0.9)

    def results_at(num_good: int, total: int = 10) -> list[RequestResult]:
        good = [_result(100, 40) for _ in range(num_good)]
        bad_kinds = [_result(300, 40), _result(100, 60), _result(None, 0, error="HTTP 500: x")]
        bad = [bad_kinds[i % 3] for i in range(total - num_good)]
        return good + bad

    mixed = summarize(
        [*results_at(7), _result(100, 999, tokens=1, latency_class="batch")], slo, duration_s=2.0
    )
    # 7 good + TTFT miss + TPOT miss + error, + a one-token answer (no TPOT, meets both).
    assert mixed.overall.attainment.both == pytest.approx(8 / 11)
    assert mixed.overall.attainment.ttft_only == pytest.approx(9 / 11)
    assert mixed.overall.attainment.tpot_only == pytest.approx(9 / 11)
    assert mixed.overall.num_errors == 1
    assert mixed.by_class["batch"].attainment.both == 1.0
    assert mixed.request_throughput == pytest.approx(10 / 2.0)
    assert mixed.errors == {"HTTP 500: x": 1}

    sweep_points = [
        (rate, summarize(results_at(good), slo, 1.0).overall.attainment.both)
        for rate, good in [(1.0, 10), (2.0, 10), (4.0, 9), (8.0, 6), (16.0, 1)]
    ]
    assert [p[1] for p in sweep_points] == [1.0, 1.0, 0.9, 0.6, 0.1]
    g = goodput(sweep_points, target=0.9)
    assert (g.rate, g.interpolated, g.bounded) == (4.0, 4.0, True)

    g = goodput([(8, 0.5), (1, 1.0), (2, 0.95), (4, 0.8)], target=0.9)
    assert g.rate == 2 and g.interpolated == pytest.approx(2 + (0.05 / 0.15) * 2)
    assert goodput([(1, 0.5), (2, 0.1)]).rate is None
    assert goodput([(1, 0.5), (2, 0.1)]).interpolated is None
    unbounded = goodput([(1, 1.0), (2, 0.99)])
    assert (unbounded.rate, unbounded.interpolated, unbounded.bounded) == (2, 2, False)
    # Highest passing rate, even past a dip.
    assert goodput([(1, 1.0), (2, 0.5), (4, 0.95), (8, 0.0)]).rate == 4


def test_steady_throughput_counts_the_full_loop_only() -> None:
    """A closed loop at concurrency 2: the window runs from the end of the first two requests
    (3.5 s) to the start of the last (5.0 s); a chunk carrying two tokens counts twice."""
    def req(i: int, start: float, ttft: float, tokens: int = 4,
            error: str | None = None) -> RequestResult:
        return RequestResult(index=i, latency_class="standard", prompt_tokens=8,
                             max_tokens=tokens, output_tokens=tokens, start_s=start,
                             ttft_s=ttft, e2e_s=ttft + 1.5, itl_s=(0.5, 0.5, 0.5), error=error)

    loop = [req(0, 0.0, 1.0), req(1, 0.0, 2.0), req(2, 2.5, 1.0), req(3, 3.5, 1.0),
            req(4, 5.0, 1.0)]
    # in [3.5, 5.0]: r1's last chunk, all 4 of r2's, r3's first 2
    assert steady_output_throughput(loop, 2) == pytest.approx(7 / 1.5)
    doubled = [*loop[:2], req(2, 2.5, 1.0, tokens=8), *loop[3:]]
    assert steady_output_throughput(doubled, 2) == pytest.approx(11 / 1.5)
    assert steady_output_throughput(loop[:2], 2) is None  # one wave: no full loop
    assert steady_output_throughput([*loop, req(5, 5.0, 1.0, error="HTTP 500")], 2) is None
    assert steady_output_throughput([], 2) is None


def test_poisson_and_gamma_arrivals() -> None:
    n, rate = 20_000, 4.0
    poisson = arrival_times(n, rate, burstiness=1.0, seed=7)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and len(poisson) == n
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_times(n, rate, burstiness=0.25, seed=7))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # CV^2 = 1/shape
    np.testing.assert_array_equal(poisson, arrival_times(n, rate, 1.0, seed=7))
    assert not np.array_equal(poisson, arrival_times(n, rate, 1.0, seed=8))
    np.testing.assert_array_equal(arrival_times(5, math.inf, 1.0, seed=0), np.zeros(5))


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://example.com",
        "http://127.0.0.1.evil.com:80",
        "http://localhost.example:80",
        "http://0.0.0.0:8000",
    ],
)
def test_refuses_non_local_targets(url: str) -> None:
    with pytest.raises(NonLocalTargetError, match="only local targets"):
        RunConfig(url=url)


def test_accepts_local_targets_and_cli_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    for url in ["http://127.0.0.1:8000/", "http://localhost:1", "https://[::1]:8443"]:
        assert not RunConfig(url=url).url.endswith("/")
    with pytest.raises(ConfigError):
        RunConfig(url="ftp://127.0.0.1")
    assert cli_main(["run", "--url", "http://192.168.1.5:8000", "--quiet"]) == 2
    assert "only local targets" in capsys.readouterr().err


def test_workloads() -> None:
    chat = build_requests(named_workload("chat"), 200, seed=1)
    assert all(64 <= s.prompt_len <= 256 and 64 <= s.output_len <= 128 for s in chat)
    assert all(len(s.prompt.split()) == s.prompt_len for s in chat)
    assert len({s.prompt for s in chat}) == 200  # no shared prompts for a prefix cache
    assert build_requests(named_workload("chat"), 200, seed=1) == chat

    summ = build_requests(named_workload("summarize"), 50, seed=1)
    assert all(1000 <= s.prompt_len <= 2000 and s.output_len <= 40 for s in summ)

    mixed = build_requests(named_workload("mixed"), 2000, seed=2)
    interactive = sum(s.latency_class == "interactive" for s in mixed)
    assert interactive / 2000 == pytest.approx(0.8, abs=0.03)
    assert {s.latency_class for s in mixed} == {"interactive", "batch"}
    assert all(s.prompt_len >= 1000 for s in mixed if s.latency_class == "batch")

    three = build_requests(named_workload("mixed3-cpu"), 500, seed=3)
    assert {s.latency_class for s in three} == {"interactive", "standard", "batch"}


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    assert LengthDist.parse("128") == LengthDist("fixed", 128)
    assert set(LengthDist.parse("uniform:3,5").sample(rng, 500)) == {3, 4, 5}
    normal = LengthDist.parse("normal:500,50,450,520").sample(rng, 5000)
    assert normal.min() >= 450 and normal.max() <= 520
    lognormal = LengthDist.parse("lognormal:300,0.5").sample(rng, 20_000)
    assert np.median(lognormal) == pytest.approx(300, rel=0.05) and lognormal.min() >= 1
    for bad in ["uniform:5", "gauss:1,2", "uniform:9,3", "fixed:x"]:
        with pytest.raises(ConfigError):
            LengthDist.parse(bad)


def test_prompts_with_a_local_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from bench.loadgen.prompts import WORDS

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    prompt = synthetic_prompt(77, np.random.default_rng(0), loaded)
    assert len(loaded.encode(prompt)) == 77
    with pytest.raises(ConfigError):
        load_tokenizer(tmp_path / "missing")
