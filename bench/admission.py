"""Overload control: goodput of a 1P1D cluster at 2x its capacity, admission on vs off.

    python -m bench.admission --out docs/bench/admission.json

One command, one machine, one run:

1. starts the cluster `pdserve cluster up --prefill 1 --decode 1` starts (`LocalCluster` with
   its default placement: decode worker on every CPU, prefill worker on every CPU at nice 5)
   with admission control on (the router's default) and per-class TTFT deadlines
   (`--deadline interactive=2 ...`, passed to the router as `--ttft-deadline`);
2. finds its capacity (or takes `--capacity-rps`): a short ascending sweep of open-loop
   Poisson rates on the workload (`mixed3-cpu`: interactive chat, standard mid-length and
   batch long prompts, each sent with its `X-Latency-Class`), stopping at the first rate
   where fewer than `--target` of the requests meet their class's TTFT deadline and the TPOT
   SLO; capacity = the highest rate that passed;
3. offers `--factor` (2) x capacity: the same seeded requests at the same arrival times,
   first to that cluster (admission on), then to a fresh cluster started with
   `--no-admission`;
4. prints and writes (`--out`, JSON with per-request records) offered / completed / rejected
   (429 or 503, with or without Retry-After) / errors / hangs (client timeouts, or still
   running when the run's time ran out) / goodput (requests per second of run time that
   completed within their class's deadline and the TPOT SLO) / p50 and p99 TTFT of the
   completed requests, the goodput ratio, and after each run the workers' KV blocks (free ==
   total once idle, else blocks leaked) and the router's in-flight gauge and rejection
   counters. Also the CPU (lscpu model and flags) and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.goodput import TIMINGS_HEADER, loadavg, machine_info
from bench.loadgen.config import SLO, RunConfig
from bench.loadgen.errors import LoadgenError
from bench.loadgen.metrics import Percentiles, RequestResult, meets_slo
from bench.loadgen.prompts import load_tokenizer
from bench.loadgen.runner import RunResult, run_load
from bench.loadgen.workload import LATENCY_CLASSES, named_workload

DEFAULT_DEADLINES = ("interactive=2", "standard=20", "batch=30")
_SWEEP_SEED_OFFSET = 100  # sweep rate i uses seed + 100 + i: no prompt shared with the 2x run
REJECT_STATUSES = (429, 503)


# --------------------------------------------------------------------------- machine


def lscpu() -> dict[str, Any]:
    """lscpu's model name and flags, and the flags that matter for the engine's kernels."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    flags = fields.get("Flags", "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    return {
        "model_name": fields.get("Model name"),
        "cpus": fields.get("CPU(s)"),
        "threads_per_core": fields.get("Thread(s) per core"),
        "key_flags": {f: f in flags for f in wanted},
        "flags": " ".join(flags),
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average: {loadavg()}"


# --------------------------------------------------------------------------- the cluster


def start_cluster(args: argparse.Namespace, admission: bool, log_dir: Path) -> Any:
    from pdserve.cluster import LocalCluster

    router_args = [a for spec in args.deadline for a in ("--ttft-deadline", spec)]
    router_args += ["--deadline-factor", str(args.deadline_factor), "--log-level", "WARNING"]
    if not admission:
        router_args.append("--no-admission")
    cluster = LocalCluster(prefill=1, decode=1, model=args.model_path,
                           extra_worker_args=("--log-level", "WARNING"),
                           router_args=tuple(router_args), log_dir=log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    return cluster


def _metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def worker_blocks(cluster: Any, name: str) -> tuple[int, int]:
    text = httpx.get(cluster.metrics_url(name), timeout=5, trust_env=False).text
    free = total = -1
    for metric, _, value in _metric_samples(text):
        if metric == "pdserve_engine_kv_blocks_free":
            free = int(value)
        elif metric == "pdserve_engine_kv_blocks_total":
            total = int(value)
    return free, total


def settle_and_check(cluster: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """After a run: wait until every worker's KV blocks are free again (or `timeout_s`);
    report blocks still held (leaked), the router's in-flight gauge and rejection counters."""
    deadline = time.monotonic() + timeout_s
    blocks: dict[str, dict[str, int]] = {}
    while True:
        blocks = {}
        for name in ("prefill-0", "decode-0"):
            free, total = worker_blocks(cluster, name)
            blocks[name] = {"free": free, "total": total, "leaked": total - free}
        if all(b["leaked"] == 0 for b in blocks.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    text = httpx.get(cluster.http_url + "/metrics", timeout=5, trust_env=False).text
    in_flight = None
    rejections: dict[str, float] = {}
    for metric, labels, value in _metric_samples(text):
        if metric == "pdserve_router_in_flight":
            in_flight = value
        elif metric == "pdserve_router_rejections_total":
            key = f"{labels.get('latency_class')}/{labels.get('reason')}"
            rejections[key] = rejections.get(key, 0.0) + value
    return {"kv_blocks": blocks, "leaked_blocks": sum(b["leaked"] for b in blocks.values()),
            "router_in_flight": in_flight, "router_rejections": rejections}


def log_events(path: Path) -> dict[str, int]:
    """Warning and error events in a router log (structlog JSON lines), by event name."""
    counts: dict[str, int] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return counts
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("warning", "error", "critical"):
            key = f"{entry['level']}:{entry.get('event')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# --------------------------------------------------------------------------- outcomes


def outcome(r: RequestResult) -> str:
    if r.ok:
        return "completed"
    if r.status in REJECT_STATUSES:
        return "rejected"
    error = r.error or ""
    if r.status is None and ("Timeout" in error or error.startswith("unfinished")):
        return "hang"
    return "error"


def _pct(values: Sequence[float]) -> Percentiles | None:
    return Percentiles.of(list(values))


def summarize_run(run: RunResult) -> dict[str, Any]:
    slo = run.config.slo
    reqs = run.requests
    kinds = [outcome(r) for r in reqs]
    good = [r for r in reqs if meets_slo(r, slo)]
    done = [r for r in reqs if r.ok and r.ttft_s is not None]
    ttft = _pct([r.ttft_s * 1000 for r in done if r.ttft_s is not None])
    tpot = _pct([t * 1000 for r in done if (t := r.tpot_s) is not None])
    duration = run.summary.duration_s
    per_class = {}
    for cls in LATENCY_CLASSES:
        rs = [(r, k) for r, k in zip(reqs, kinds, strict=True) if r.latency_class == cls]
        if not rs:
            continue
        c_ttft = _pct([r.ttft_s * 1000 for r, k in rs if k == "completed" and r.ttft_s])
        per_class[cls] = {
            "offered": len(rs),
            "completed": sum(k == "completed" for _, k in rs),
            "rejected": sum(k == "rejected" for _, k in rs),
            "errors": sum(k == "error" for _, k in rs),
            "hangs": sum(k == "hang" for _, k in rs),
            "good": sum(meets_slo(r, slo) for r, _ in rs),
            "ttft_p50_ms": c_ttft.p50 if c_ttft else None,
            "ttft_p99_ms": c_ttft.p99 if c_ttft else None,
        }
    rejected = [r for r, k in zip(reqs, kinds, strict=True) if k == "rejected"]
    return {
        "rate": run.config.rate,
        "offered": len(reqs) + run.summary.num_unsent,
        "sent": len(reqs),
        "completed": kinds.count("completed"),
        "rejected": len(rejected),
        "rejected_429": sum(r.status == 429 for r in rejected),
        "rejected_503": sum(r.status == 503 for r in rejected),
        "rejected_with_retry_after": sum(r.retry_after_s is not None for r in rejected),
        "errors": kinds.count("error"),
        "hangs": kinds.count("hang"),
        "good": len(good),
        "attainment": len(good) / len(reqs) if reqs else 0.0,
        "duration_s": duration,
        "goodput_rps": len(good) / duration if duration > 0 else 0.0,
        "throughput_rps": len(done) / duration if duration > 0 else 0.0,
        "ttft_ms": asdict(ttft) if ttft else None,
        "tpot_ms": asdict(tpot) if tpot else None,
        "by_class": per_class,
        "error_messages": run.summary.errors,
    }


# --------------------------------------------------------------------------- reporting


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def table(on: dict[str, Any], off: dict[str, Any]) -> str:
    def row(label: str, fmt: Any) -> str:
        return f"| {label} | {fmt(on)} | {fmt(off)} |"

    def ttft(s: dict[str, Any], key: str) -> str:
        return _ms(s["ttft_ms"][key] if s["ttft_ms"] else None)

    def rejected(s: dict[str, Any]) -> str:
        return (f"{s['rejected']} (429: {s['rejected_429']}, 503: {s['rejected_503']}; "
                f"Retry-After on {s['rejected_with_retry_after']})")

    lines = [
        "| | admission on | no admission |",
        "|---|---:|---:|",
        row("offered (requests, req/s)", lambda s: f"{s['offered']} @ {s['rate']:.2f}"),
        row("completed", lambda s: str(s["completed"])),
        row("rejected", rejected),
        row("errors", lambda s: str(s["errors"])),
        row("hangs (client timeout)", lambda s: str(s["hangs"])),
        row("met their class's SLO", lambda s: f"{s['good']} ({s['attainment']:.0%})"),
        row("run time s", lambda s: f"{s['duration_s']:.0f}"),
        row("**goodput req/s**", lambda s: f"**{s['goodput_rps']:.3f}**"),
        row("TTFT p50 ms (completed)", lambda s: ttft(s, "p50")),
        row("TTFT p99 ms (completed)", lambda s: ttft(s, "p99")),
        row("KV blocks leaked after the run", lambda s: str(s["check"]["leaked_blocks"])),
        row("router in flight after the run", lambda s: f"{s['check']['router_in_flight']:g}"),
        row("remote-prefill fallbacks (router log)", lambda s: str(
            s.get("router_log_events", {}).get("warning:remote_prefill_fallback", 0))),
    ]
    for cls in LATENCY_CLASSES:
        if cls in on["by_class"]:
            def per(s: dict[str, Any], cls: str = cls) -> str:
                c = s["by_class"][cls]
                return (f"{c['offered']} / {c['completed']} / {c['rejected']} / {c['good']} / "
                        f"{_ms(c['ttft_p99_ms'])}")
            lines.append(row(f"{cls}: offered / completed / rejected / good / TTFT p99 ms", per))
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| rate req/s | requests | completed | rejected | met SLO | TTFT p50 / p99 ms |",
             "|---:|---:|---:|---:|---:|---|"]
    for s in rows:
        t = s["ttft_ms"]
        lines.append(f"| {s['rate']:g} | {s['sent']} | {s['completed']} | {s['rejected']} "
                     f"| {s['attainment']:.0%} | {_ms(t and t['p50'])} / {_ms(t and t['p99'])} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run


def _slo(args: argparse.Namespace) -> SLO:
    from router.admission import parse_deadlines

    try:
        deadlines = parse_deadlines(args.deadline)
    except ValueError as exc:
        raise LoadgenError(f"--deadline: {exc}") from None
    per_class = tuple((cls.value, s * 1000.0, args.tpot_slo_ms) for cls, s in deadlines.items())
    default_ttft = max(s for s in deadlines.values()) * 1000.0
    return SLO(ttft_ms=default_ttft, tpot_ms=args.tpot_slo_ms, target=args.target,
               per_class=per_class)


async def _run(config: RunConfig, tokenizer: Any, desc: str, quiet: bool) -> RunResult:
    return await run_load(config, tokenizer=tokenizer, progress=not quiet, desc=desc)


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if len({d.partition("=")[0] for d in args.deadline}) != len(LATENCY_CLASSES):
        raise LoadgenError("--deadline: give one CLASS=SECONDS for each of "
                           + ", ".join(LATENCY_CLASSES))
    from pdserve.engine.model_store import resolve_model

    tokenizer_path = str(resolve_model(args.model_path or "default", progress=False))
    tokenizer = load_tokenizer(tokenizer_path)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-admission-"))
    started = time.monotonic()
    record: dict[str, Any] = {
        "command": "python -m bench.admission " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {**machine_info(), "lscpu": lscpu()},
        "uptime_start": uptime(),
        "workload": args.workload,
        "deadlines_s": list(args.deadline),
        "tpot_slo_ms": args.tpot_slo_ms,
        "target": args.target,
        "factor": args.factor,
        "layout": "LocalCluster(prefill=1, decode=1) default placement (as `pdserve cluster "
                  "up`): decode worker --cpus on all CPUs, prefill worker all CPUs at nice 5; "
                  "router --ttft-deadline per class (--no-admission for the baseline)",
        "log_dir": str(log_dir),
    }
    base = RunConfig(
        url="http://127.0.0.1:1",
        workload=named_workload(args.workload),
        slo=_slo(args),
        seed=args.seed,
        headers={TIMINGS_HEADER: "1"},
        request_timeout_s=args.request_timeout,
        tokenizer_path=tokenizer_path,
    )
    runs: dict[str, dict[str, Any]] = {}
    results: dict[str, RunResult] = {}
    for name, admission in (("admission", True), ("none", False)):
        cluster = start_cluster(args, admission, log_dir / name)
        t0 = time.monotonic()
        with cluster:
            print(f"{name}: cluster up in {time.monotonic() - t0:.0f}s at {cluster.http_url}",
                  file=sys.stderr)
            config = replace(base, url=cluster.http_url)
            if admission and args.capacity_rps is None:
                sweep_rows = []
                capacity = None
                for i, rate in enumerate(args.sweep_rates):
                    sweep_cfg = replace(config, rate=rate, num_requests=args.sweep_requests,
                                        seed=args.seed + _SWEEP_SEED_OFFSET + i,
                                        warmup_requests=2 if i == 0 else 0,
                                        max_duration_s=args.sweep_requests / rate + args.drain)
                    run = await _run(sweep_cfg, tokenizer, f"sweep {rate:g}", args.quiet)
                    row = summarize_run(run)
                    sweep_rows.append(row)
                    print(f"sweep {rate:g} req/s: {row['attainment']:.0%} met the SLO",
                          file=sys.stderr)
                    if row["attainment"] < args.target:
                        break
                    capacity = rate
                    settle_and_check(cluster, 30)
                record["capacity_sweep"] = sweep_rows
                if capacity is None:
                    capacity = args.sweep_rates[0]
                    record["capacity_note"] = "no swept rate met the SLO; took the lowest"
                record["capacity_rps"] = capacity
                settle_and_check(cluster, 60)
            elif admission:
                record["capacity_rps"] = args.capacity_rps
            rate = args.factor * float(record["capacity_rps"])
            overload = replace(config, rate=rate, num_requests=args.requests,
                               warmup_requests=2,  # both clusters warmed the same way
                               max_duration_s=args.requests / rate + args.drain)
            check_before = settle_and_check(cluster, 60)
            load_before = loadavg()
            run = await _run(overload, tokenizer, f"{name} {rate:g} req/s", args.quiet)
            summary = summarize_run(run)
            summary["check_before"] = check_before
            summary["check"] = settle_and_check(cluster, 60)
            summary["router_log_events"] = log_events(log_dir / name / "router.log")
            summary["loadavg_before"], summary["loadavg_after"] = load_before, loadavg()
            runs[name] = summary
            results[name] = run
            print(f"{name}: {summary['good']} good, {summary['rejected']} rejected, "
                  f"goodput {summary['goodput_rps']:.3f} req/s", file=sys.stderr)
    on, off = runs["admission"], runs["none"]
    ratio = on["goodput_rps"] / off["goodput_rps"] if off["goodput_rps"] > 0 else math.inf
    record["runs"] = runs
    record["goodput_ratio"] = ratio
    record["uptime_end"] = uptime()
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["requests"] = {name: [asdict(r) for r in run.requests]
                          for name, run in results.items()}
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON record to write")
    p.add_argument("--capacity-rps", type=float, help="skip the sweep: the cluster's capacity")
    p.add_argument("--sweep-rates", type=lambda t: [float(x) for x in t.split(",")],
                   default=[0.15, 0.25, 0.4, 0.6],
                   help="ascending req/s tried to find capacity (default 0.15,0.25,0.4,0.6)")
    p.add_argument("--sweep-requests", type=int, default=12, help="per sweep rate (default 12)")
    p.add_argument("--factor", type=float, default=2.0, help="offered load / capacity (2)")
    p.add_argument("--requests", type=int, default=40, help="requests of the overload runs")
    p.add_argument("--workload", default="mixed3-cpu")
    p.add_argument("--deadline-factor", type=float, default=1.0,
                   help="the router's --deadline-factor (1: admitted requests are answered "
                   "within their class's deadline or get 503; the router's own default is 4)")
    p.add_argument("--deadline", action="append", default=None, metavar="CLASS=SECONDS",
                   help="TTFT deadline per class: the router's --ttft-deadline and the SLO "
                        f"(default {' '.join(DEFAULT_DEADLINES)})")
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--target", type=float, default=0.9,
                   help="fraction meeting the SLO for a swept rate to count (0.9)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="client timeout per request, s: past it a request is a hang (180)")
    p.add_argument("--drain", type=float, default=240.0,
                   help="a run may last its arrival window plus this many s (240)")
    p.add_argument("--model-path", help="model (default: the default model)")
    p.add_argument("--log-dir", type=Path, help="cluster logs (default: a temporary dir)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.deadline = args.deadline or list(DEFAULT_DEADLINES)
    try:
        record = asyncio.run(_main(args))
    except LoadgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    on, off = record["runs"]["admission"], record["runs"]["none"]
    print(f"capacity: {record['capacity_rps']:g} req/s; offered {args.factor:g}x; "
          f"deadlines {' '.join(args.deadline)}, TPOT <= {args.tpot_slo_ms:g} ms")
    if "capacity_sweep" in record:
        print(sweep_table(record["capacity_sweep"]))
        print()
    print(table(on, off))
    print(f"\ngoodput(admission) / goodput(none) = {record['goodput_ratio']:.2f}x")
    print(f"uptime start: {record['uptime_start']}\nuptime end:   {record['uptime_end']}")
    print(f"wall time {record['wall_s']:.0f} s; record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
