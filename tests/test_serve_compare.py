"""bench.serve_compare's command line: which systems it starts and how (no server is run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import serve_compare as sc


def test_levels_and_the_llama_server_command(tmp_path: Path) -> None:
    args = sc.build_parser().parse_args([
        "--systems", "llamacpp,colocated", "--levels", "1,4,16,64", "--cores", "0,1",
        "--llama-server", str(tmp_path / "llama-server"), "--gguf", str(tmp_path / "m.gguf")])
    assert args.levels == (1, 4, 16, 64)
    systems = sc.build_systems(args, tmp_path / "SmolLM2", vllm_ok=False)
    assert [s.name for s in systems] == ["llamacpp", "colocated"]
    argv = systems[0].argv(8123)
    assert argv[:3] == ["taskset", "-c", "0-1"] and argv[3] == str(tmp_path / "llama-server")
    flags = dict(zip(argv[4::2], argv[5::2], strict=True))
    assert flags["-m"] == str(tmp_path / "m.gguf") and flags["--host"] == "127.0.0.1"
    assert (flags["-t"], flags["-np"], flags["--port"], flags["--alias"]) == \
        ("2", str(sc.LLAMACPP_SLOTS), "8123", "SmolLM2")
    for bad in ("0,4", "", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            sc._levels(bad)


def test_a_missing_llama_server_says_how_to_build_it(tmp_path: Path) -> None:
    args = sc.build_parser().parse_args(["--llama-server", str(tmp_path / "none")])
    with pytest.raises(sc.LoadgenError, match=r"python -m bench\.llama_server"):
        sc.ensure_llama_server(args)


def test_variants_take_environment_and_systems_run_once(tmp_path: Path) -> None:
    args = sc.build_parser().parse_args([
        "--systems", "1p1d", "--cluster-variant", "py=PDSERVE_DECODE_LOOP=python --dtype q4_1"])
    systems = sc.build_systems(args, tmp_path / "SmolLM2", vllm_ok=False)
    variant = systems[-1]
    assert variant.name == "1p1d-py" and dict(variant.env) == {"PDSERVE_DECODE_LOOP": "python"}
    assert variant.argv(8123)[-2:] == ["--dtype", "q4_1"]
    args = sc.build_parser().parse_args(["--systems", "vllm,1p1d,vllm"])
    with pytest.raises(sc.LoadgenError, match="each system once"):
        sc.build_systems(args, tmp_path / "SmolLM2", vllm_ok=False)


def test_steady_from_a_record(tmp_path: Path) -> None:
    """--steady-from reads a serve_compare.json: the whole run's tok/s as recorded, and the
    full loop's from the per-request records (n/a with one wave)."""
    def req(start: float, ttft: float) -> dict[str, object]:
        return {"index": 0, "latency_class": "standard", "prompt_tokens": 8, "max_tokens": 4,
                "output_tokens": 4, "start_s": start, "ttft_s": ttft, "e2e_s": ttft + 1.5,
                "itl_s": [0.5, 0.5, 0.5], "status": 200, "error": None, "route": None,
                "server_timings_ms": None, "retry_after_s": None, "ok": True, "tpot_s": 0.5}

    loop = [req(0.0, 1.0), req(0.0, 2.0), req(2.5, 1.0), req(3.5, 1.0), req(5.0, 1.0)]
    record = {"systems": {"x": {"levels": {
        "2": {"summary": {"output_token_throughput": 2.5}, "requests": loop},
        "4": {"summary": {"output_token_throughput": 1.0}, "requests": loop[:2]}}}}}
    path = tmp_path / "serve_compare.json"
    path.write_text(json.dumps(record))
    assert sc.steady_from(path).splitlines()[2:] == [
        "| x | 2 | 2.5 | 4.7 |", "| x | 4 | 1.0 | n/a |"]
    assert sc.main(["--steady-from", str(path)]) == 0


def test_unserved_requests_are_told_apart_by_kind() -> None:
    """A level's check counts why requests were not served: refusals with a Retry-After (a
    server shedding load) apart from other HTTP errors and from broken connections."""
    from bench.loadgen.metrics import RequestResult

    def failed(status: int | None, error: str, retry: float | None = None) -> RequestResult:
        return RequestResult(0, "standard", 8, 4, 0, 0.0, None, None, status=status,
                             error=error, retry_after_s=retry)

    kinds = [sc._error_kind(r) for r in (
        failed(429, "HTTP 429: predicted wait", 1.0), failed(503, "HTTP 503: no first token"),
        failed(None, "ReadError: connection closed by the server" + "x" * 80))]
    assert kinds[:2] == ["429 with Retry-After", "503"]
    assert kinds[2].startswith("ReadError") and len(kinds[2]) == 60
