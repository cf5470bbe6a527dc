"""The real 1P2D cluster under bench.goodput's load, for validating the simulator.

    python -m bench.sim.real --out docs/bench/cluster_sim/real_1p2d --rates 0.2,0.45,0.8 \\
        --workload mixed-cpu --num-requests 30 --calibrate 2 --ttft-slo-ms 1500 \\
        --tpot-slo-ms 150 --class-slo batch:15000:150 --quiet

bench.goodput starts only 1P1D clusters; this starts `LocalCluster(prefill=1, decode=2)` the
way `pdserve cluster up --prefill 1 --decode 2` lays it out on this machine (decode worker i
pinned to CPU i with one torch thread, the prefill worker unpinned at nice 5 with a thread
per CPU; before stop 74 every worker ran one thread), with bench.goodput's other engine and
router flags, and sweeps it with bench.goodput's own functions, so the records have the same
format. `--systems` picks the placements (threshold, cost).

    python -m bench.sim.real streaming --out docs/bench/cluster_sim/streaming_1p1d \
        --concurrency 1,4,8,12

Calibration for the simulator, not validation: the 1P1D cluster of bench.goodput under a
closed loop of short chat requests (64-128 prompt tokens, 64 output tokens, no EOS) at a few
concurrencies; the records show what a streamed token costs beyond the engine step (gRPC,
router, gateway and client work on the same cores), which bench.cluster_sim fits. With
`--layout 1p2d` the same streams run on `pdserve cluster up`'s 1P2D (threshold placement:
every prompt local, the two decode workers streaming side by side, the prefill worker idle):
how much two decode workers slow each other in the running cluster, which bench.cluster_sim
fits as the share of the engine-level co-run table it shows (`Overheads.corun_share`).

    python -m bench.sim.real prefill --out docs/bench/cluster_sim/prefill_probe_1p1d \
        --layout 1p1d --concurrency 0,2,4,8 --probes 4

Calibration too: how fast a remote prefill runs in the cluster and how long its KV takes to
send, with the decode side idle and beside a closed loop of short chat streams. Long batch
prompts (`--prompt-tokens`, 8 output tokens) go one at a time, each prefilled on the prefill
worker (their server timings are kept); `--layout 1p2d` lays the cluster out as the 1P2D
sweep does, where the unpinned nice-5 prefill worker shares the cores with the streaming
decode workers. bench.cluster_sim replays these runs to fit the prefill side's constants,
so neither comes from the sweeps it is validated against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.goodput import (
    TIMINGS_HEADER,
    UCX_NO_SPIN_ENV,
    Setup,
    StartedSystem,
    Unloaded,
    allowed_cpus,
    build_parser,
    calibrate,
    loadavg,
    machine_info,
    replace_ns,
    router_metrics,
    write_comparison,
)
from bench.loadgen.cli import config_from_args, parse_rates
from bench.loadgen.errors import LoadgenError
from bench.loadgen.runner import SweepResult, sweep
from bench.loadgen.workload import LengthDist, Workload, custom_workload

NAMES = {"threshold": "1p2d", "cost": "1p2d-cost"}


@contextmanager
def one_p_two_d(setup: Setup, placement: str) -> Iterator[StartedSystem]:
    from pdserve.cluster import LocalCluster

    # No --threads: `pdserve cluster up` gives each decode worker one CPU (so one thread) and
    # the prefill worker a thread per CPU at nice 5, and a flag here would override that
    # (records before stop 74 ran every worker with --threads 1).
    worker_args = (*setup.engine_args(None), "--log-level", "WARNING")
    router_args = (
        "--remote-threshold", str(setup.remote_threshold),
        "--max-prefill-backlog", str(setup.max_prefill_backlog),
        "--placement", placement,
        "--log-level", "WARNING",
        *setup.router_extra,
    )  # fmt: skip
    cluster = LocalCluster(prefill=1, decode=2, model=setup.model,
                           extra_worker_args=worker_args, router_args=router_args,
                           log_dir=setup.log_dir / NAMES[placement], env=dict(setup.worker_env))
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    with cluster:
        affinity = {name: allowed_cpus(proc.pid) for name, proc in cluster.procs.items()}
        layout = (f"LocalCluster 1P2D (pdserve cluster up placement: decode-i on CPU i, "
                  f"prefill unpinned at nice {cluster.prefill_nice}: "
                  f"`{' '.join(cluster.placement('prefill', 0))}`), workers "
                  f"`{' '.join(worker_args)}`, router `{' '.join(router_args)}`")
        yield StartedSystem(NAMES[placement], cluster.http_url, layout, affinity)


async def _main(args: argparse.Namespace, placements: Sequence[str]) -> int:
    if args.tokenizer is None:
        from pdserve.engine.model_store import resolve_model

        args.tokenizer = str(resolve_model(args.model_path or "default", progress=False))
    config = config_from_args(replace_ns(args, header=[*args.header, f"{TIMINGS_HEADER}:1"]),
                              "http://127.0.0.1:1")
    setup = Setup(model=args.model_path, kv_cache_mb=args.kv_cache_mb,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_prefill_chunk=args.max_prefill_chunk, step_target_ms=args.step_target_ms,
                  interactive_step_target_ms=args.interactive_step_target_ms,
                  remote_threshold=args.remote_threshold,
                  max_prefill_backlog=args.max_prefill_backlog,
                  router_extra=tuple(args.router_arg),
                  log_dir=args.log_dir or args.out / "logs",
                  worker_env={} if args.ucx_spin else dict(UCX_NO_SPIN_ENV))
    notes: dict[str, Any] = {"command": "python -m bench.sim.real " + " ".join(sys.argv[1:]),
                             "machine": machine_info(),
                             "setup": {k: str(v) for k, v in vars(setup).items()},
                             "systems": {}}
    results: dict[str, SweepResult] = {}
    unloaded: dict[str, list[Unloaded]] = {}
    for i, placement in enumerate(placements):
        if i and args.cooldown > 0:
            await asyncio.sleep(args.cooldown)
        started, before = time.monotonic(), loadavg()
        with one_p_two_d(setup, placement) as system:
            print(f"{system.name}: {system.url} {system.layout} {dict(system.affinity)}",
                  file=sys.stderr)
            cfg = replace(config, url=system.url)
            if args.calibrate:
                unloaded[system.name] = await calibrate(cfg, args.calibrate)
            results[system.name] = await sweep(cfg, parse_rates(args.rates), label=system.name,
                                               progress=not args.quiet,
                                               cooldown_s=args.cooldown, fresh_prompts=True)
            # Its first tokens against cost placement's predictions, among others.
            metrics = await asyncio.to_thread(router_metrics, system.url)
        notes["systems"][system.name] = {
            "layout": system.layout, "affinity": dict(system.affinity),
            "loadavg_before": before, "loadavg_after": loadavg(),
            "wall_s": round(time.monotonic() - started, 1), "router_metrics": metrics}
    print(write_comparison(results, args.out, notes=notes, unloaded=unloaded))
    print(json.dumps(notes, indent=2), file=sys.stderr)
    return 0


async def streaming(out: Path, concurrencies: Sequence[int], per_stream: int,
                    log_dir: Path, layout: str = "1p1d") -> int:
    from bench.goodput import disaggregated
    from bench.loadgen.config import RunConfig
    from bench.loadgen.report import run_to_dict, write_json
    from bench.loadgen.runner import run_load

    workload = _chat_streams()
    notes: dict[str, Any] = {
        "command": "python -m bench.sim.real " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "loadavg_before": loadavg(), "layout_name": layout,
        "runs": {}}
    setup = Setup(log_dir=log_dir)
    notes["setup"] = {k: str(v) for k, v in vars(setup).items()}
    system_cm = disaggregated(setup) if layout == "1p1d" else one_p_two_d(setup, "threshold")
    with system_cm as system:
        notes["layout"], notes["affinity"] = system.layout, dict(system.affinity)
        for i, c in enumerate(concurrencies):
            cfg = RunConfig(url=system.url, workload=workload, num_requests=per_stream * c,
                            concurrency=c, ignore_eos=True, seed=100 + i,
                            warmup_requests=1 if i == 0 else 0,
                            headers={TIMINGS_HEADER: "1"})
            run = await run_load(cfg)
            write_json(out / f"concurrency_{c}.json", run_to_dict(run))
            tpot = run.summary.overall.tpot_ms
            notes["runs"][c] = {"tpot_p50_ms": tpot and tpot.p50,
                                "errors": run.summary.overall.num_errors}
            print(f"concurrency {c}: TPOT p50 {tpot and tpot.p50:.1f} ms", file=sys.stderr)
    notes["loadavg_after"] = loadavg()
    (out / "setup.json").write_text(json.dumps(notes, indent=2) + "\n")
    return 0


def _chat_streams() -> Workload:
    return custom_workload(LengthDist("uniform", 64, 128), LengthDist("fixed", 64), "interactive")


async def prefill_probes(out: Path, layout: str, concurrencies: Sequence[int], probes: int,
                         prompt_tokens: int, log_dir: Path) -> int:
    """Per concurrency c: `probes` long prompts one at a time, each prefilled remotely, beside
    c closed-loop chat streams started 2 s before them (none for c = 0). The streams run
    for a window of 3x the idle pass's probe time; probes slowed past it finish after the
    streams stop, and the records (both runs, on one clock) show when each ran."""
    from bench.goodput import disaggregated
    from bench.loadgen.config import RunConfig
    from bench.loadgen.report import run_to_dict, write_json
    from bench.loadgen.runner import run_load

    probe_workload = custom_workload(LengthDist("fixed", prompt_tokens), LengthDist("fixed", 8),
                                     "batch")
    setup = Setup(log_dir=log_dir)
    notes: dict[str, Any] = {
        "command": "python -m bench.sim.real " + " ".join(sys.argv[1:]),
        "machine": machine_info(), "loadavg_before": loadavg(), "layout_name": layout,
        "setup": {k: str(v) for k, v in vars(setup).items()}, "runs": {}}
    system_cm = disaggregated(setup) if layout == "1p1d" else one_p_two_d(setup, "threshold")
    window = 0.0
    with system_cm as system:
        notes["layout"], notes["affinity"] = system.layout, dict(system.affinity)
        for i, c in enumerate(concurrencies):
            probe_cfg = RunConfig(url=system.url, workload=probe_workload, num_requests=probes,
                                  concurrency=1, seed=200 + i, warmup_requests=1 if i == 0 else 0,
                                  headers={TIMINGS_HEADER: "1"})
            streams = None
            if c:
                if not window:
                    raise SystemExit("--concurrency must start with 0 (the idle pass)")
                streams = asyncio.create_task(run_load(RunConfig(
                    url=system.url, workload=_chat_streams(), num_requests=100_000,
                    concurrency=c, ignore_eos=True, seed=300 + i, max_duration_s=window,
                    headers={TIMINGS_HEADER: "1"})))
                await asyncio.sleep(2.0)
            probe = await run_load(probe_cfg)
            write_json(out / f"probes_c{c}.json", run_to_dict(probe))
            run: dict[str, Any] = {"probe_started_at": probe.started_at}
            if streams is not None:
                stream_run = await streams
                write_json(out / f"streams_c{c}.json", run_to_dict(stream_run))
                run["streams_started_at"] = stream_run.started_at
            else:
                window = 2.0 + 3.0 * max(r.e2e_s or 0.0 for r in probe.requests) * probes
            computes = [(r.server_timings_ms or {}).get("prefill_compute_ms")
                        for r in probe.requests]
            run["prefill_compute_ms"] = computes
            run["routes"] = [r.route for r in probe.requests]
            notes["runs"][c] = run
            print(f"concurrency {c}: prefill compute ms {computes}", file=sys.stderr)
    notes["loadavg_after"] = loadavg()
    (out / "setup.json").write_text(json.dumps(notes, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["prefill"]:
        pp = argparse.ArgumentParser(prog="python -m bench.sim.real prefill")
        pp.add_argument("--out", type=Path, required=True)
        pp.add_argument("--layout", choices=("1p1d", "1p2d"), default="1p1d")
        pp.add_argument("--concurrency", default="0,2,4,8",
                        help="chat streams beside the probes; the first must be 0")
        pp.add_argument("--probes", type=int, default=4, help="long prompts per concurrency")
        pp.add_argument("--prompt-tokens", type=int, default=1146,
                        help="the mixed-cpu workload's mean long-batch prompt")
        pp.add_argument("--log-dir", type=Path, default=Path("/tmp/pdserve-prefill-probe-logs"))
        a = pp.parse_args(args_list[1:])
        a.out.mkdir(parents=True, exist_ok=True)
        return asyncio.run(prefill_probes(a.out, a.layout,
                                          [int(c) for c in a.concurrency.split(",")],
                                          a.probes, a.prompt_tokens, a.log_dir))
    if args_list[:1] == ["streaming"]:
        sp = argparse.ArgumentParser(prog="python -m bench.sim.real streaming")
        sp.add_argument("--out", type=Path, required=True)
        sp.add_argument("--layout", choices=("1p1d", "1p2d"), default="1p1d",
                        help="1p2d: `pdserve cluster up`'s, threshold placement (the chat "
                             "prompts stay local: two decode workers stream side by side)")
        sp.add_argument("--concurrency", default="1,4,8,12")
        sp.add_argument("--per-stream", type=int, default=3, help="requests per stream")
        sp.add_argument("--log-dir", type=Path, default=Path("/tmp/pdserve-streaming-logs"))
        a = sp.parse_args(args_list[1:])
        a.out.mkdir(parents=True, exist_ok=True)
        return asyncio.run(streaming(a.out, [int(c) for c in a.concurrency.split(",")],
                                     a.per_stream, a.log_dir, a.layout))
    parser = build_parser()
    parser.prog = "python -m bench.sim.real"
    parser.set_defaults(systems="threshold,cost")
    args = parser.parse_args(argv)
    placements = [p.strip() for p in args.systems.split(",") if p.strip()]
    if not placements or set(placements) - set(NAMES):
        print(f"error: --systems: some of {', '.join(NAMES)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, placements))
    except LoadgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
