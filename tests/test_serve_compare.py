"""bench.serve_compare's command line: which systems it starts and how (no server is run)."""

from __future__ import annotations

import argparse
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
