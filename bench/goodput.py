"""Goodput under SLOs: colocated vs disaggregated serving, same workload, same seed.

    python -m bench.goodput --colocated-url http://127.0.0.1:8001 \\
        --disagg-url http://127.0.0.1:8002 --rates 0.5,1,2,4,8 --workload mixed \\
        --ttft-slo-ms 500 --tpot-slo-ms 50 --num-requests 200 --out results/goodput

Both endpoints must already be running (starting the clusters is not wired in yet). The
systems are swept one after the other, never at the same time, so they never compete for the
machine. Writes `<out>/<system>/` (one sweep each: per-rate JSON, summary.json, plots),
`<out>/slo_attainment.png` and `<out>/latency.png` with both systems on the same axes, and
`<out>/comparison.md`, which is also printed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from bench.loadgen.cli import add_load_arguments, config_from_args, parse_rates
from bench.loadgen.config import RunConfig
from bench.loadgen.errors import LoadgenError
from bench.loadgen.plots import plot_sweeps
from bench.loadgen.report import compare, write_sweep
from bench.loadgen.runner import SweepResult, sweep

BASELINE = "colocated"


async def sweep_systems(
    config: RunConfig,
    urls: Mapping[str, str],
    rates: Sequence[float],
    *,
    progress: bool = True,
    cooldown_s: float = 0.0,
) -> dict[str, SweepResult]:
    """Sweep every system in `urls` (name -> base URL) with `config`'s workload, seed and SLOs.

    `config.url` is replaced per system; everything else is shared, so the systems see the
    same requests at the same arrival times.
    """
    results: dict[str, SweepResult] = {}
    for name, url in urls.items():
        system_config = replace(config, url=url)
        results[name] = await sweep(
            system_config, rates, label=name, progress=progress, cooldown_s=cooldown_s
        )
    return results


def write_comparison(results: Mapping[str, SweepResult], out_dir: Path) -> str:
    """Per-system sweep outputs, shared-axes plots and comparison.md; returns the markdown."""
    for name, result in results.items():
        write_sweep(out_dir / name, result)
    plot_sweeps(results, out_dir)
    table = compare(results, baseline=BASELINE if BASELINE in results else None)
    (out_dir / "comparison.md").write_text(table + "\n")
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description="Compare goodput of colocated and disaggregated serving under SLOs.",
    )
    parser.add_argument("--colocated-url", required=True, help="e.g. http://127.0.0.1:8001")
    parser.add_argument("--disagg-url", required=True, help="e.g. http://127.0.0.1:8002")
    parser.add_argument("--rates", required=True, help="comma-separated req/s, e.g. 0.5,1,2,4")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--cooldown", type=float, default=5.0, metavar="S", help="pause between rates (default 5)"
    )
    add_load_arguments(parser)
    return parser


async def _main(args: argparse.Namespace) -> int:
    # TODO(cluster wiring): start both systems here (e.g. `async with colocated_cluster(...)`)
    # and pass their URLs on; for now they must already be running.
    urls = {BASELINE: args.colocated_url, "disaggregated": args.disagg_url}
    config = config_from_args(args, args.colocated_url)
    for url in urls.values():
        replace(config, url=url)  # validates every URL before any load is sent
    results = await sweep_systems(
        config, urls, parse_rates(args.rates), progress=not args.quiet, cooldown_s=args.cooldown
    )
    print(write_comparison(results, args.out))
    return 0


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
