"""Results as JSON files and markdown tables."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.loadgen.metrics import GroupSummary, Percentiles, RequestResult
from bench.loadgen.runner import RunResult, SweepResult


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, mappings and sequences as plain JSON values; non-finite floats as strings
    (JSON has no Infinity)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def request_to_dict(r: RequestResult) -> dict[str, Any]:
    """One request as measured, with its derived `ok` and `tpot_s`."""
    return {**to_jsonable(r), "ok": r.ok, "tpot_s": r.tpot_s}


def run_to_dict(run: RunResult, *, include_requests: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": run.model,
        "started_at": run.started_at,
        "config": to_jsonable(run.config),
        "summary": to_jsonable(run.summary),
    }
    if include_requests:
        out["requests"] = [request_to_dict(r) for r in run.requests]
    return out


def sweep_to_dict(result: SweepResult) -> dict[str, Any]:
    return {
        "label": result.label,
        "slo": to_jsonable(result.config.slo),
        "goodput": to_jsonable(result.goodput),
        "config": to_jsonable(result.config),
        "runs": [
            {"rate": to_jsonable(run.config.rate), **run_to_dict(run, include_requests=False)}
            for run in result.runs
        ],
    }


def write_json(path: Path, payload: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_sweep(out_dir: Path, result: SweepResult, *, plots: bool = True) -> list[Path]:
    """`rate_<r>.json` per rate (with per-request records), `summary.json`, and the plots."""
    written = [
        write_json(out_dir / f"rate_{run.config.rate:g}.json", run_to_dict(run))
        for run in result.runs
    ]
    written.append(write_json(out_dir / "summary.json", sweep_to_dict(result)))
    if plots:
        from bench.loadgen.plots import plot_sweeps

        written += plot_sweeps({result.label or "system": result}, out_dir)
    return written


def _ms(p: Percentiles | None, attr: str) -> str:
    return "n/a" if p is None else f"{getattr(p, attr):.1f}"


def _rate(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def format_run(run: RunResult) -> str:
    """A human-readable markdown summary of one run."""
    s = run.summary
    slo = run.config.slo
    c = run.config
    mode = f"concurrency {c.concurrency}" if c.closed_loop else f"rate {c.rate:g} req/s"
    lines = [
        f"model {run.model}  {mode}  "
        f"sent {s.num_sent} (unsent {s.num_unsent})  duration {s.duration_s:.2f} s",
        f"throughput {s.request_throughput:.3f} req/s, {s.output_token_throughput:.1f} output "
        f"tok/s, {s.input_token_throughput:.1f} input tok/s",
        f"SLO: {slo.describe()}",
        "",
        "| class | n | errors | SLO att. | TTFT att. | TPOT att. | TTFT p50/p90/p99 ms "
        "| TPOT p50/p90/p99 ms | ITL p99 ms | E2E p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: list[tuple[str, GroupSummary]] = [("all", s.overall), *s.by_class.items()]
    for name, g in groups:
        a = g.attainment
        lines.append(
            f"| {name} | {g.num_requests} | {g.num_errors} | {a.both:.1%} | {a.ttft_only:.1%} "
            f"| {a.tpot_only:.1%} | {_pcts(g.ttft_ms)} | {_pcts(g.tpot_ms)} "
            f"| {_ms(g.itl_ms, 'p99')} | {_ms(g.e2e_ms, 'p99')} |"
        )
    for message, count in s.errors.items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)


def _pcts(p: Percentiles | None) -> str:
    return "n/a" if p is None else f"{p.p50:.1f} / {p.p90:.1f} / {p.p99:.1f}"


def compare(results_by_system: Mapping[str, SweepResult], baseline: str | None = None) -> str:
    """Markdown: goodput per system (with its ratio to `baseline`, default the first system),
    then the per-rate numbers side by side."""
    if not results_by_system:
        raise ValueError("nothing to compare")
    base_name = baseline or next(iter(results_by_system))
    base = results_by_system[base_name].goodput
    target = base.target
    lines = [
        f"Goodput: highest swept rate with >= {target:.0%} of requests meeting both SLOs.",
        "",
        f"| system | goodput (req/s) | interpolated (req/s) | vs {base_name} |",
        "|---|---|---|---|",
    ]
    for name, result in results_by_system.items():
        g = result.goodput
        ratio = "n/a"
        if g.interpolated is not None and base.interpolated:
            ratio = f"{g.interpolated / base.interpolated:.2f}x"
        more = "" if g.bounded else " (not reached: sweep higher)"
        if g.rate is None and result.rates:
            more = f" (below {target:.0%} down to {min(result.rates):g} req/s: sweep lower)"
        lines.append(f"| {name} | {_rate(g.rate)} | {_rate(g.interpolated)}{more} | {ratio} |")
    lines += [
        "",
        "| rate (req/s) | system | requests | SLO att. | p99 TTFT interactive ms | p99 TTFT ms "
        "| p99 TPOT ms | req/s | output tok/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(
        (
            (run.config.rate, name, run)
            for name, result in results_by_system.items()
            for run in result.runs
        ),
        key=lambda row: row[:2],
    )
    for rate, name, run in rows:
        s = run.summary
        interactive = s.by_class.get("interactive")
        lines.append(
            f"| {rate:g} | {name} | {len(run.requests)} | {s.overall.attainment.both:.1%} "
            f"| {_ms(interactive.ttft_ms if interactive else None, 'p99')} "
            f"| {_ms(s.overall.ttft_ms, 'p99')} | {_ms(s.overall.tpot_ms, 'p99')} "
            f"| {s.request_throughput:.2f} | {s.output_token_throughput:.1f} "
            f"| {s.overall.num_errors} |"
        )
    return "\n".join(lines)
