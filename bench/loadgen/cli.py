"""`python -m bench.loadgen {run,sweep}`. Flags are read here and nowhere else."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.loadgen.config import SLO, RunConfig
from bench.loadgen.errors import ConfigError, LoadgenError
from bench.loadgen.report import compare, format_run, run_to_dict, write_json, write_sweep
from bench.loadgen.runner import run_load, sweep
from bench.loadgen.workload import (
    LATENCY_CLASSES,
    NAMED_WORKLOADS,
    LengthDist,
    Workload,
    custom_workload,
    named_workload,
)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload, load shape and SLO flags (everything but the target and the rates)."""
    w = parser.add_argument_group("workload")
    w.add_argument(
        "--api",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    w.add_argument("--model", help="model name to send (default: first of GET /v1/models)")
    w.add_argument(
        "--workload",
        choices=sorted(NAMED_WORKLOADS),
        help="named mix (default chat); exclusive with --prompt-len/--output-len",
    )
    w.add_argument(
        "--prompt-len",
        help="custom prompt length, e.g. fixed:512, uniform:64,256, "
        "normal:512,128[,lo,hi], lognormal:512,0.5[,lo,hi]",
    )
    w.add_argument("--output-len", help="custom output length (same syntax)")
    w.add_argument(
        "--latency-class",
        choices=LATENCY_CLASSES,
        default="standard",
        help="latency class of a custom workload",
    )
    w.add_argument("--tokenizer", metavar="DIR", help="local tokenizer for exact prompt lengths")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true')
    w.add_argument(
        "--temperature",
        default="0",
        help="sampling temperature to send, or 'none' to omit it (default 0)",
    )
    w.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="extra JSON object merged into every request body",
    )
    w.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="extra HTTP header (repeatable)",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=100)
    load.add_argument(
        "--max-duration",
        type=float,
        default=600.0,
        metavar="S",
        help="hard cap on one run's length in seconds",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrivals; 1 = Poisson, < 1 burstier",
    )
    load.add_argument("--max-concurrency", type=int, help="cap on in-flight open-loop requests")
    load.add_argument(
        "--max-retry-after",
        type=float,
        default=30.0,
        metavar="S",
        help="closed loop: a worker whose request was refused with Retry-After waits that "
        "long, at most S seconds, before its next request (0: never waits)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="unmeasured requests sent one by one first",
    )
    load.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="per-request read timeout"
    )
    load.add_argument("--quiet", action="store_true", help="no progress bar")
    slo = parser.add_argument_group("SLO")
    slo.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    slo.add_argument("--tpot-slo-ms", type=float, default=100.0)
    slo.add_argument(
        "--class-slo",
        action="append",
        default=[],
        metavar="CLASS:TTFT_MS:TPOT_MS",
        help="SLO for one latency class instead of the two above (repeatable), "
        "e.g. batch:20000:150",
    )
    slo.add_argument(
        "--slo-target",
        type=float,
        default=0.9,
        help="fraction of requests that must meet both SLOs (goodput)",
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.prompt_len or args.output_len:
        if args.workload:
            raise ConfigError("--workload and --prompt-len/--output-len are exclusive")
        if not (args.prompt_len and args.output_len):
            raise ConfigError("a custom workload needs both --prompt-len and --output-len")
        return custom_workload(
            LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len), args.latency_class
        )
    return named_workload(args.workload or "chat")


def config_from_args(args: argparse.Namespace, url: str, **overrides: Any) -> RunConfig:
    headers = {}
    for item in args.header:
        name, sep, value = item.partition(":")
        if not sep:
            raise ConfigError(f"--header {item!r} must look like NAME:VALUE")
        headers[name.strip()] = value.strip()
    try:
        temperature = None if args.temperature.lower() == "none" else float(args.temperature)
    except ValueError:
        raise ConfigError(
            f"--temperature must be a number or 'none', not {args.temperature!r}"
        ) from None
    fields: dict[str, Any] = dict(
        url=url,
        api=args.api,
        model=args.model,
        workload=workload_from_args(args),
        num_requests=args.num_requests,
        max_duration_s=args.max_duration,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        max_retry_after_s=args.max_retry_after,
        seed=args.seed,
        slo=SLO(
            args.ttft_slo_ms, args.tpot_slo_ms, args.slo_target, parse_class_slos(args.class_slo)
        ),
        ignore_eos=args.ignore_eos,
        temperature=temperature,
        extra_body=args.extra_body,
        headers=headers,
        request_timeout_s=args.timeout,
        warmup_requests=args.warmup,
        tokenizer_path=args.tokenizer,
    )
    fields.update(overrides)
    return RunConfig(**fields)


def parse_class_slos(items: Sequence[str]) -> tuple[tuple[str, float, float], ...]:
    out = []
    for item in items:
        parts = item.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            out.append((parts[0], float(parts[1]), float(parts[2])))
        except ValueError:
            raise ConfigError(
                f"--class-slo {item!r} must look like CLASS:TTFT_MS:TPOT_MS, e.g. batch:20000:150"
            ) from None
        if parts[0] not in LATENCY_CLASSES:
            raise ConfigError(f"--class-slo: unknown latency class {parts[0]!r}")
    return tuple(out)


def add_rate_search_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--raise-rates / --lower-rates: a sweep goes past its planned rates until every system has a
    goodput and a rate it fails at (`runner.sweep`'s `raise_until_below` / `lower_until_met`);
    --min-rate-seconds: each rate is held that long (`min_seconds`)."""
    parser.add_argument(
        "--raise-rates",
        type=int,
        default=4,
        metavar="N",
        help="while the highest rate still meets the SLOs, go on at 1.5x it, up "
        "to N more rates, so the sweep finds where a system breaks (default 4)",
    )
    parser.add_argument(
        "--lower-rates",
        type=int,
        default=2,
        metavar="N",
        help="while no rate meets the SLOs, go on at the lowest / 1.5, up to N "
        "more rates while that raises the attainment, so every system gets a "
        "goodput (default 2)",
    )
    parser.add_argument(
        "--min-rate-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="each rate sends at least rate x S requests, so it is held for S "
        "seconds, not absorbed as a burst (default 60; 0: --num-requests only)",
    )


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ConfigError("--rates needs positive rates")
    return rates


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen",
        description="Streamed load against an OpenAI-compatible endpoint on this machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one bounded run at one rate or concurrency")
    run.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="open-loop request rate in req/s (default inf: all at once)",
    )
    mode.add_argument("--concurrency", type=int, help="closed loop with this many in flight")
    run.add_argument("--out", type=Path, help="write the full result JSON here")
    add_load_arguments(run)
    sw = sub.add_parser("sweep", help="one run per rate; goodput, JSON and plots")
    sw.add_argument("--url", required=True)
    sw.add_argument("--rates", required=True, help="comma-separated, e.g. 0.5,1,2,4")
    sw.add_argument("--out", type=Path, required=True, help="output directory")
    sw.add_argument("--label", default="system", help="name of the system in plots/tables")
    sw.add_argument("--cooldown", type=float, default=0.0, metavar="S", help="pause between rates")
    sw.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="seed + i for the i-th rate, so a prefix cache never sees a prompt twice",
    )
    add_rate_search_arguments(sw)
    add_load_arguments(sw)
    return parser


async def _main(args: argparse.Namespace) -> int:
    progress = not args.quiet
    if args.command == "run":
        config = config_from_args(args, args.url, rate=args.rate, concurrency=args.concurrency)
        result = await run_load(config, progress=progress)
        print(format_run(result))
        if args.out:
            write_json(args.out, run_to_dict(result))
        return 0
    config = config_from_args(args, args.url)
    result_sweep = await sweep(
        config,
        parse_rates(args.rates),
        label=args.label,
        progress=progress,
        cooldown_s=args.cooldown,
        fresh_prompts=args.fresh_prompts,
        raise_until_below=args.raise_rates,
        lower_until_met=args.lower_rates,
        min_seconds=args.min_rate_seconds,
    )
    for path in write_sweep(args.out, result_sweep):
        print(f"wrote {path}", file=sys.stderr)
    print(compare({args.label: result_sweep}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except LoadgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
