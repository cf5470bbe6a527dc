"""Goodput under SLOs: colocated vs disaggregated serving on the same cores, same workload.

    python -m bench.goodput --out docs/bench/goodput --rates 0.1,0.2,0.3,0.45,0.7 \\
        --workload mixed-cpu --num-requests 30 --ttft-slo-ms 1500 --tpot-slo-ms 150 \\
        --class-slo batch:15000:150

One command starts each system itself, sweeps it, and stops it before starting the next, so
the two never compete for the machine:

- **colocated**: `python -m pdserve.gateway` (one engine doing prefill and decode, chunked prefill)
  pinned to all of `--cores` with one torch thread per core;
- **disaggregated** (1P1D): a `LocalCluster` whose prefill worker is pinned to
  `--prefill-cores` and decode worker to `--decode-cores` (one torch thread per core each);
  the router and its HTTP gateway are left unpinned (they are light). Prompts with at least
  `--remote-threshold` uncached tokens are prefilled on the prefill worker.

Both get the same model, engine flags, KV pool per engine, requests, seeds and arrival times;
the i-th rate uses seed + i so that no prompt repeats across rates (the prefix cache would
otherwise serve later rates from memory). `--colocated-url` / `--disagg-url` sweep an
already-running endpoint instead of starting that system.

Writes `<out>/<system>/` (one sweep each: per-rate JSON with per-request records and server
stage timings, summary.json, plots), `<out>/slo_attainment.png`, `<out>/latency.png` and
`<out>/interactive.png` with both systems on the same axes, and `<out>/comparison.md` (SLOs,
unloaded latencies, goodput, per-rate table, where the time goes), which is also printed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.loadgen.cli import (
    add_load_arguments,
    add_rate_search_arguments,
    config_from_args,
    parse_rates,
)
from bench.loadgen.config import RunConfig
from bench.loadgen.errors import LoadgenError, TargetError
from bench.loadgen.metrics import Percentiles, RequestResult
from bench.loadgen.plots import plot_sweeps
from bench.loadgen.report import compare, request_to_dict, write_json, write_sweep
from bench.loadgen.runner import RunResult, SweepResult, run_load, sweep
from bench.loadgen.workload import Workload
from pdserve.cluster import free_port
from pdserve.engine.config import EngineConfig

# ucxx's default "thread" progress mode awaits every UCX request with a yield loop on the
# event loop, so a decode worker (whose KV receiver always has a receive posted per connected
# prefill worker) spins a whole core while idle; with Python futures a notifier thread
# completes them instead (idle: ~3 % of a core). `--ucx-spin` keeps ucxx's default.
UCX_NO_SPIN_ENV = {"UCXPY_ENABLE_PYTHON_FUTURE": "1"}

BASELINE = "colocated"
DISAGG = "disaggregated"
DISAGG_COST = "disaggregated-cost"  # the same 1P1D cluster, router --placement cost
TIMINGS_HEADER = "X-Pdserve-Timings"
_CALIBRATION_SEED_OFFSET = 7_000_001  # unloaded probes must not share prompts with the sweep

# The workload, SLOs and rates of the sweep docs/BENCHMARKS.md reports ("Goodput: colocated
# vs disaggregated"), as this command's flags; bench/serve_compare.py sweeps the same.
DOCUMENTED_SWEEP = (
    "--rates", "0.2,0.35,0.55,0.9", "--workload", "mixed-cpu", "--num-requests", "30",
    "--ttft-slo-ms", "1000", "--tpot-slo-ms", "125", "--class-slo", "batch:15000:125",
)  # fmt: skip


# --------------------------------------------------------------------------- the two systems


@dataclass(frozen=True)
class Setup:
    """What both systems share (model and engine flags) and how each is laid out on cores."""

    model: str | None = None  # None: the default model
    cores: tuple[int, ...] = (0, 1)  # colocated engine
    prefill_cores: tuple[int, ...] = (0,)
    decode_cores: tuple[int, ...] = (1,)
    kv_cache_mb: int = 512
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    step_target_ms: float = EngineConfig().step_target_ms
    interactive_step_target_ms: float = EngineConfig().interactive_step_target_ms
    remote_threshold: int = 512
    max_prefill_backlog: int = 1_000_000
    router_extra: tuple[str, ...] = ()  # more router flags (--router-arg)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="goodput-")))
    worker_env: Mapping[str, str] = field(default_factory=lambda: dict(UCX_NO_SPIN_ENV))
    start_timeout_s: float = 300.0

    def engine_args(self, threads: int | None) -> list[str]:
        """The engine's flags; `threads` None: no --threads (the worker's default, a torch
        thread per CPU it may run on)."""
        args = [
            *(() if threads is None else ("--threads", str(threads))),
            "--kv-cache-mb", str(self.kv_cache_mb),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--max-prefill-chunk", str(self.max_prefill_chunk),
            "--step-target-ms", f"{self.step_target_ms:g}",
            "--interactive-step-target-ms", f"{self.interactive_step_target_ms:g}",
        ]  # fmt: skip
        return args + (["--model", self.model] if self.model else [])


@dataclass(frozen=True)
class StartedSystem:
    name: str
    url: str
    layout: str  # one line: what runs where
    affinity: Mapping[str, str]  # process -> CPUs it may run on, read back from /proc


def _cpus(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def allowed_cpus(pid: int) -> str:
    """The union of Cpus_allowed_list over a process's threads, e.g. "0" or "0-1"."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return " | ".join(sorted(lists))


def pin_process(pid: int, cores: Sequence[int]) -> str:
    """Pin every thread of a running process to `cores` (threads it starts later inherit the
    mask of their creator). Returns the mask read back."""
    for _ in range(2):  # a thread started during the first pass is caught by the second
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), set(cores))
            except ProcessLookupError:
                pass  # the thread ended
    return allowed_cpus(pid)


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TargetError(f"server exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TargetError(f"{url} not ready within {timeout_s:.0f}s; see {log}")


@contextmanager
def colocated(setup: Setup) -> Iterator[StartedSystem]:
    """`python -m pdserve.gateway`: one engine with one torch thread per core, pinned by taskset."""
    port = free_port()
    argv = [
        "taskset", "-c", _cpus(setup.cores), sys.executable, "-m", "pdserve.gateway",
        "--port", str(port), "--log-level", "WARNING", *setup.engine_args(len(setup.cores)),
    ]  # fmt: skip
    log = setup.log_dir / "colocated.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, setup.start_timeout_s, log)
        shown = " ".join(argv[argv.index("--log-level") :])
        layout = f"`taskset -c {_cpus(setup.cores)} python -m pdserve.gateway {shown}`"
        yield StartedSystem(BASELINE, url, layout, {"engine+gateway": allowed_cpus(proc.pid)})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def disaggregated(setup: Setup, placement: str = "threshold") -> Iterator[StartedSystem]:
    """1P1D LocalCluster: each worker pinned to its cores with one torch thread per core;
    the router decides local vs remote prefill by `placement` (threshold or cost)."""
    from pdserve.cluster import LocalCluster

    if len(setup.prefill_cores) != len(setup.decode_cores):
        # One --threads flag goes to every worker; different core counts would need two.
        raise LoadgenError("--prefill-cores and --decode-cores must have as many cores each")
    worker_args = (*setup.engine_args(len(setup.decode_cores)), "--log-level", "WARNING")
    router_args = (
        "--remote-threshold", str(setup.remote_threshold),
        "--max-prefill-backlog", str(setup.max_prefill_backlog),
        "--placement", placement,
        "--log-level", "WARNING",
        *setup.router_extra,
    )  # fmt: skip
    cluster = LocalCluster(
        prefill=1,
        decode=1,
        model=setup.model,
        extra_worker_args=worker_args,
        router_args=router_args,
        log_dir=setup.log_dir / ("disaggregated" if placement == "threshold"
                                 else f"disaggregated-{placement}"),
        env=dict(setup.worker_env),
    )
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    with cluster:
        affinity = {
            "prefill worker": pin_process(cluster.procs["prefill-0"].pid, setup.prefill_cores),
            "decode worker": pin_process(cluster.procs["decode-0"].pid, setup.decode_cores),
            "router+gateway": allowed_cpus(cluster.procs["router"].pid),
        }
        layout = (
            f"LocalCluster 1P1D, workers `{' '.join(worker_args)}`, prefill worker on CPU "
            f"{_cpus(setup.prefill_cores)}, decode worker on CPU {_cpus(setup.decode_cores)}, "
            f"router `{' '.join(router_args)}` unpinned"
        )
        if setup.worker_env:
            layout += ", env " + " ".join(f"{k}={v}" for k, v in setup.worker_env.items())
        name = DISAGG if placement == "threshold" else f"{DISAGG}-{placement}"
        yield StartedSystem(name, cluster.http_url, layout, affinity)


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Unloaded:
    """Latencies of one request class sent one at a time to an idle system."""

    request_class: str
    latency_class: str
    n: int
    prompt_tokens: float
    ttft_ms: Percentiles | None
    tpot_ms: Percentiles | None
    # Each request as measured (route, server stage timings), written to unloaded.json.
    requests: tuple[RequestResult, ...] = field(default=(), compare=False, repr=False)


async def calibrate(config: RunConfig, n: int) -> list[Unloaded]:
    """`n` requests of each class of the workload, one at a time (closed loop, concurrency 1)."""
    out = []
    for cls in config.workload.classes:
        probe = replace(
            config,
            workload=Workload(f"unloaded-{cls.name}", (replace(cls, weight=1.0),)),
            num_requests=n,
            concurrency=1,
            seed=config.seed + _CALIBRATION_SEED_OFFSET,
            warmup_requests=1,  # the first request after start-up is slow (lazy init)
        )
        run = await run_load(probe)
        ok = [r for r in run.requests if r.ok]
        if len(ok) < len(run.requests):
            raise TargetError(f"unloaded {cls.name} requests failed: {run.summary.errors}")
        tpots = [t * 1000 for r in ok if (t := r.tpot_s) is not None]
        out.append(
            Unloaded(
                cls.name,
                cls.latency_class,
                n,
                float(np.mean([r.prompt_tokens for r in ok])),
                Percentiles.of([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
                Percentiles.of(tpots),
                tuple(run.requests),
            )
        )
    return out


# Stage timings the router reports for a remote prefill, in ms from its arrival: choosing
# workers (route_ms), the decode worker's allocation RPC, the prefill worker's queue, compute
# and KV transfer (no longer covering the release of its blocks), and the hand-off (dispatching
# the prefill RPC, admission into the decode batch, the first token's trip back). They add up
# to ttft_ms, so "rest" below (ttft minus the four stages listed here) is route_ms +
# handoff_ms and never negative. Local prefills report route_ms and local_prefill_ms.
_STAGES = ("decode_allocate_ms", "prefill_queued_ms", "prefill_compute_ms", "kv_transfer_ms")


@dataclass(frozen=True)
class StageRow:
    rate: float
    latency_class: str
    route: str
    n: int
    ttft_ms: float  # client-measured, median
    stages_ms: Mapping[str, float]  # medians (+ "rest_ms"); empty for local prefill
    kv_mb: float | None


def stage_breakdown(run: RunResult) -> list[StageRow]:
    groups: dict[tuple[str, str], list[RequestResult]] = {}
    for r in run.requests:
        if r.ok and r.ttft_s is not None:
            groups.setdefault((r.latency_class, r.route or "?"), []).append(r)
    rows = []
    for (latency_class, route), rs in sorted(groups.items()):
        remote = [
            t
            for r in rs
            if (t := r.server_timings_ms) and "prefill_compute_ms" in t and "ttft_ms" in t
        ]
        stages: dict[str, float] = {}
        kv_mb = None
        if remote:
            for key in _STAGES:
                stages[key] = float(np.median([t.get(key, 0.0) for t in remote]))
            rest = [t["ttft_ms"] - sum(t.get(key, 0.0) for key in _STAGES) for t in remote]
            stages["rest_ms"] = float(np.median(rest))
            kv_mb = float(np.median([t.get("kv_bytes", 0.0) for t in remote])) / 1e6
        ttfts = [r.ttft_s * 1000 for r in rs if r.ttft_s is not None]
        rows.append(
            StageRow(
                run.config.rate,
                latency_class,
                route,
                len(rs),
                float(np.median(ttfts)),
                stages,
                kv_mb,
            )
        )
    return rows


# --------------------------------------------------------------------------- reporting


def _p(p: Percentiles | None, attr: str = "p50") -> str:
    return "n/a" if p is None else f"{getattr(p, attr):.0f}"


def _f(value: float | None, digits: int = 0) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def unloaded_table(unloaded: Mapping[str, list[Unloaded]]) -> str:
    lines = [
        "| system | class | n | prompt tokens | TTFT p50 ms | TTFT max ms | TPOT p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for system, rows in unloaded.items():
        for u in rows:
            lines.append(
                f"| {system} | {u.request_class} ({u.latency_class}) | {u.n} "
                f"| {u.prompt_tokens:.0f} | {_p(u.ttft_ms)} | {_p(u.ttft_ms, 'max')} "
                f"| {_p(u.tpot_ms)} |"
            )
    return "\n".join(lines)


def interactive_table(results: Mapping[str, SweepResult]) -> str:
    lines = [
        "| rate (req/s) | system | SLO att. all | SLO att. interactive | TTFT att. interactive "
        "| TPOT att. interactive | p50 / p99 TTFT interactive ms | p50 / p99 TPOT interactive ms "
        "| p99 / max ITL interactive ms | p99 TTFT batch ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(
        ((run.config.rate, name, run) for name, res in results.items() for run in res.runs),
        key=lambda row: row[:2],
    )
    for rate, name, run in rows:
        s = run.summary
        inter = s.by_class.get("interactive")
        batch = s.by_class.get("batch")
        if inter is None:
            continue
        a = inter.attainment
        lines.append(
            f"| {rate:g} | {name} | {s.overall.attainment.both:.0%} | {a.both:.0%} "
            f"| {a.ttft_only:.0%} | {a.tpot_only:.0%} "
            f"| {_p(inter.ttft_ms)} / {_p(inter.ttft_ms, 'p99')} "
            f"| {_p(inter.tpot_ms)} / {_p(inter.tpot_ms, 'p99')} "
            f"| {_p(inter.itl_ms, 'p99')} / {_p(inter.itl_ms, 'max')} "
            f"| {_p(batch.ttft_ms if batch else None, 'p99')} | {s.overall.num_errors} |"
        )
    return "\n".join(lines)


def stage_table(results: Mapping[str, SweepResult]) -> str:
    lines = [
        "| system | rate | class | route | n | TTFT (client) | decode alloc | prefill queue "
        "| prefill compute | KV transfer | rest (route, dispatch, admission, first token back) "
        "| KV MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results.items():
        for run in res.runs:
            for row in stage_breakdown(run):
                st = row.stages_ms
                lines.append(
                    f"| {name} | {row.rate:g} | {row.latency_class} | {row.route} | {row.n} "
                    f"| {row.ttft_ms:.0f} | {_f(st.get('decode_allocate_ms'))} "
                    f"| {_f(st.get('prefill_queued_ms'))} "
                    f"| {_f(st.get('prefill_compute_ms'))} | {_f(st.get('kv_transfer_ms'), 1)} "
                    f"| {_f(st.get('rest_ms'))} | {_f(row.kv_mb, 1)} |"
                )
    return "\n".join(lines)


def plot_interactive(results: Mapping[str, SweepResult], path: Path) -> Path:
    """Interactive-class TTFT and all-request TPOT (p50 dotted, p99 solid) per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(results.values()))
    ttft_slo, tpot_slo = first.config.slo.limits("interactive")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (("TTFT of interactive requests", "ttft_ms", ttft_slo), ("TPOT", "tpot_ms", tpot_slo))
    for ax, (title, attr, limit) in zip(axes, panels, strict=True):
        for i, (name, res) in enumerate(results.items()):
            points = []
            for run in res.runs:
                group = run.summary.by_class.get("interactive") if attr == "ttft_ms" else None
                p = getattr(group or run.summary.overall, attr)
                if p is not None and math.isfinite(run.config.rate):
                    points.append((run.config.rate, p))
            xs = [x for x, _ in points]
            for pct, style in (("p50", ":"), ("p99", "-")):
                ys = [getattr(p, pct) for _, p in points]
                ax.plot(xs, ys, style, marker="o", color=colors[i], label=f"{name} {pct}")
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms (log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cpus_online": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "kernel": platform.release(),
    }


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def write_comparison(
    results: Mapping[str, SweepResult],
    out_dir: Path,
    *,
    notes: Mapping[str, Any] | None = None,
    unloaded: Mapping[str, list[Unloaded]] | None = None,
) -> str:
    """Per-system sweep outputs, shared-axes plots and comparison.md; returns the markdown."""
    for name, result in results.items():
        write_sweep(out_dir / name, result)
    plot_sweeps(results, out_dir)
    plot_interactive(results, out_dir / "interactive.png")
    first = next(iter(results.values()))
    parts = [f"SLOs: {first.config.slo.describe()}; goodput target {first.config.slo.target:.0%}."]
    if unloaded:
        parts += ["", "Unloaded (one request at a time):", "", unloaded_table(unloaded)]
        for name, rows in unloaded.items():
            write_json(out_dir / name / "unloaded.json",
                       {row.request_class: [request_to_dict(r) for r in row.requests]
                        for row in rows})
    parts += [
        "",
        compare(results, baseline=BASELINE if BASELINE in results else None),
        "",
        "Interactive requests:",
        "",
        interactive_table(results),
        "",
        "Where the time to first token goes (medians in ms; stages as the router reports them):",
        "",
        stage_table(results),
    ]
    table = "\n".join(parts)
    (out_dir / "comparison.md").write_text(table + "\n")
    if notes is not None:
        write_json(out_dir / "setup.json", notes)
    return table


# --------------------------------------------------------------------------- command line


def _cores(text: str) -> tuple[int, ...]:
    try:
        cores = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated CPU ids, got {text!r}"
        ) from None
    if not cores:
        raise argparse.ArgumentTypeError("no CPUs given")
    return cores


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description="Compare goodput of colocated and disaggregated serving under SLOs.",
    )
    parser.add_argument("--rates", required=True, help="comma-separated req/s, e.g. 0.2,0.5,1")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--cooldown", type=float, default=5.0, metavar="S", help="pause between rates (default 5)"
    )
    add_rate_search_arguments(parser)
    parser.add_argument(
        "--calibrate",
        type=int,
        default=3,
        metavar="N",
        help="first send N requests of each class one at a time to the idle system (0: skip)",
    )
    parser.add_argument(
        "--systems",
        default=f"{BASELINE},{DISAGG}",
        help=f"which to run, in order (default {BASELINE},{DISAGG})",
    )
    s = parser.add_argument_group("systems (started by this command unless a URL is given)")
    s.add_argument("--colocated-url", help="sweep this running endpoint instead")
    s.add_argument("--disagg-url", help="sweep this running endpoint instead")
    s.add_argument("--model-path", help="model for both systems (default: the default model)")
    s.add_argument("--cores", type=_cores, default=(0, 1), help="colocated engine (default 0,1)")
    s.add_argument("--prefill-cores", type=_cores, default=(0,), help="default 0")
    s.add_argument("--decode-cores", type=_cores, default=(1,), help="default 1")
    s.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool per engine")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--max-prefill-chunk", type=int, default=512)
    s.add_argument("--step-target-ms", type=float, default=EngineConfig().step_target_ms)
    s.add_argument("--interactive-step-target-ms", type=float,
                   default=EngineConfig().interactive_step_target_ms)
    s.add_argument("--remote-threshold", type=int, default=512)
    s.add_argument(
        "--max-prefill-backlog",
        type=int,
        default=1_000_000,
        help="router: queued prefill tokens above which prefill stays local (default: never)",
    )
    s.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the disaggregated systems' router, repeatable "
        "(--router-arg=--remote-overhead-window --router-arg=0)",
    )
    s.add_argument(
        "--ucx-spin",
        action="store_true",
        help=f"keep ucxx's busy-waiting default (do not set {' '.join(UCX_NO_SPIN_ENV)})",
    )
    s.add_argument("--log-dir", type=Path, help="server logs (default: <out>/logs)")
    add_load_arguments(parser)
    return parser


async def _main(args: argparse.Namespace) -> int:
    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = set(systems) - {BASELINE, DISAGG, DISAGG_COST}
    if unknown or not systems:
        raise LoadgenError(f"--systems: expected some of {BASELINE}, {DISAGG}, {DISAGG_COST}; "
                           f"got {args.systems!r}")
    if args.tokenizer is None:  # exact prompt lengths with the served model's tokenizer
        from pdserve.engine.model_store import resolve_model

        args.tokenizer = str(resolve_model(args.model_path or "default", progress=False))
    headers = [*args.header, f"{TIMINGS_HEADER}:1"]
    config = config_from_args(replace_ns(args, header=headers), "http://127.0.0.1:1")
    rates = parse_rates(args.rates)
    setup = Setup(
        model=args.model_path,
        cores=args.cores,
        prefill_cores=args.prefill_cores,
        decode_cores=args.decode_cores,
        kv_cache_mb=args.kv_cache_mb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk, step_target_ms=args.step_target_ms,
        interactive_step_target_ms=args.interactive_step_target_ms,
        remote_threshold=args.remote_threshold,
        max_prefill_backlog=args.max_prefill_backlog,
        router_extra=tuple(args.router_arg),
        log_dir=args.log_dir or args.out / "logs",
        worker_env={} if args.ucx_spin else dict(UCX_NO_SPIN_ENV),
    )
    given = {BASELINE: args.colocated_url, DISAGG: args.disagg_url, DISAGG_COST: None}
    starters = {BASELINE: colocated, DISAGG: disaggregated,
                DISAGG_COST: functools.partial(disaggregated, placement="cost")}
    notes: dict[str, Any] = {
        "command": "python -m bench.goodput " + " ".join(sys.argv[1:]),
        "machine": machine_info(),
        "setup": {k: str(v) for k, v in vars(setup).items()},
        "systems": {},
    }
    results: dict[str, SweepResult] = {}
    unloaded: dict[str, list[Unloaded]] = {}
    for i, name in enumerate(systems):
        if i and args.cooldown > 0:
            await asyncio.sleep(args.cooldown)
        started_at = time.monotonic()
        load_before = loadavg()
        with _system(name, given[name], starters[name], setup) as system:
            print(
                f"{name}: {system.url}  {system.layout}  {dict(system.affinity)}", file=sys.stderr
            )
            system_config = replace(config, url=system.url)
            if args.calibrate:
                unloaded[name] = await calibrate(system_config, args.calibrate)
            results[name] = await sweep(
                system_config,
                rates,
                label=name,
                progress=not args.quiet,
                cooldown_s=args.cooldown,
                fresh_prompts=True,
                raise_until_below=args.raise_rates,
                lower_until_met=args.lower_rates,
                min_seconds=args.min_rate_seconds,
            )
            metrics = await asyncio.to_thread(router_metrics, system.url)
        notes["systems"][name] = {
            "layout": system.layout,
            "affinity": dict(system.affinity),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "wall_s": round(time.monotonic() - started_at, 1),
            "router_metrics": metrics,
        }
    print(write_comparison(results, args.out, notes=notes, unloaded=unloaded))
    print(json.dumps(notes, indent=2), file=sys.stderr)
    return 0


def router_metrics(url: str) -> list[str]:
    """The router's decisions, its first tokens against cost placement's predictions
    (pdserve_router_ttft_*) and its learned remote overhead, from the system's /metrics at
    the end of its sweep (over the calibration and every rate); none without a router."""
    try:
        page = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return [f"# /metrics: {exc!r}"]
    keep = ("pdserve_router_ttft_", "pdserve_router_remote_overhead_",
            "pdserve_router_decisions_total")
    return [line for line in page.splitlines()
            if line.startswith(keep) and "_created" not in line]


def replace_ns(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


@contextmanager
def _system(name: str, url: str | None, start: Any, setup: Setup) -> Iterator[StartedSystem]:
    if url is not None:
        yield StartedSystem(name, url, f"already running at {url}", {})
        return
    with start(setup) as system:
        yield system


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except LoadgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
