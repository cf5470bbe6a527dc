"""Sweep plots (matplotlib, Agg): SLO attainment vs rate, DistServe style, and latency
percentiles vs rate. Every function takes several systems so that they share the axes."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.loadgen.metrics import Attainment, Percentiles, RunSummary
from bench.loadgen.runner import SweepResult

_PERCENTILES = (("p50", ":"), ("p90", "--"), ("p99", "-"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _points(result: SweepResult) -> list[tuple[float, RunSummary]]:
    """(rate, summary) per run; an infinite rate cannot be placed on the axis."""
    return [(run.config.rate, run.summary) for run in result.runs if math.isfinite(run.config.rate)]


def plot_attainment(results_by_system: Mapping[str, SweepResult], path: Path) -> Path:
    plt = _pyplot()
    panels: list[tuple[str, Callable[[Attainment], float]]] = [
        ("TTFT and TPOT SLOs", lambda a: a.both),
        ("TTFT SLO only", lambda a: a.ttft_only),
        ("TPOT SLO only", lambda a: a.tpot_only),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    first = next(iter(results_by_system.values()))
    slo = first.config.slo
    for ax, (title, pick) in zip(axes, panels, strict=True):
        for name, result in results_by_system.items():
            points = _points(result)
            ys = [100.0 * pick(summary.overall.attainment) for _, summary in points]
            ax.plot([rate for rate, _ in points], ys, marker="o", label=name)
        ax.axhline(
            100.0 * slo.target,
            color="grey",
            linestyle="--",
            linewidth=1,
            label=f"{slo.target:.0%} target",
        )
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[0].legend()
    fig.suptitle(f"SLO attainment vs rate ({slo.describe()})", fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(results_by_system: Mapping[str, SweepResult], path: Path) -> Path:
    plt = _pyplot()
    first = next(iter(results_by_system.values()))
    slo = first.config.slo
    panels: list[tuple[str, Callable[[RunSummary], Percentiles | None], float]] = [
        ("TTFT", lambda s: s.overall.ttft_ms, slo.ttft_ms),
        ("TPOT", lambda s: s.overall.tpot_ms, slo.tpot_ms),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, pick, limit) in zip(axes, panels, strict=True):
        for i, (name, result) in enumerate(results_by_system.items()):
            measured = [(rate, p) for rate, summary in _points(result) if (p := pick(summary))]
            xs = [rate for rate, _ in measured]
            for pct, style in _PERCENTILES:
                ys = [float(getattr(p, pct)) for _, p in measured]
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    linestyle=style,
                    color=colors[i % len(colors)],
                    label=f"{name} {pct}",
                )
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
        ax.set_title(f"{metric} vs rate")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{metric} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweeps(results_by_system: Mapping[str, SweepResult], out_dir: Path) -> list[Path]:
    return [
        plot_attainment(results_by_system, out_dir / "slo_attainment.png"),
        plot_latency(results_by_system, out_dir / "latency.png"),
    ]
