"""Where the time to first token goes: remote prefill (1P1D) versus local prefill.

    python -m bench.bench_ttft --lengths 512,2048 --reps 3

Starts a 1P1D LocalCluster (prefill worker pinned to `--prefill-cores`, decode worker to
`--decode-cores`, one torch thread per core each) with a low remote threshold, and sends
single prompts of each length through the router's gRPC API with `return_timings`, one at a
time, after one unmeasured warm-up request per length. The first token's time splits into

- prefill queue: arrival at the prefill worker until its prefill was scheduled;
- prefill compute: the prompt's forward pass on the prefill worker;
- KV transfer: the KV pages over UCX into the decode worker's pool;
- decode admission: router-measured first-token time minus the three above, i.e. everything
  else: choosing workers, the decode allocation RPC, dispatching the prefill RPC, admitting
  the request into the decode batch and the first token's trip back to the router (the
  router reports these as route_ms + decode_allocate_ms + handoff_ms; the stages add up).

The router measures `first_token_ms` from its arrival (after tokenizing); the client-side
TTFT below includes that and the client's gRPC hop. Then
the same prompts are prefilled locally on the decode worker (a second cluster whose remote
threshold no prompt reaches), for comparison. Every prompt is fresh random token ids, so no
prefix cache helps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.goodput import UCX_NO_SPIN_ENV, loadavg, machine_info, pin_process

LOCAL_THRESHOLD = 1_000_000  # no prompt is this long: every prefill stays on the decode worker
# --modes: (both workers' extra flags, the prefill worker's); "local": prefilled on the decode
# worker. "remote" is the default cluster: the same-host KV path, KV sent while computing.
MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "remote": ((), ()),
    "remote-after": ((), ("--no-kv-overlap",)),
    "remote-ucx": (("--no-kv-shm",), ()),
    "remote-ucx-after": (("--no-kv-shm",), ("--no-kv-overlap",)),
    "local": ((), ()),
}


@dataclass(frozen=True)
class Sample:
    mode: str  # "remote" or "local": where the cluster was told to prefill
    route: str  # where the router says it did
    prompt_tokens: int
    client_ttft_ms: float
    first_token_ms: float  # router-measured (remote path only; 0 for local)
    queued_ms: float
    prefill_compute_ms: float
    kv_transfer_ms: float
    total_ms: float

    @property
    def admission_ms(self) -> float:
        return self.first_token_ms - self.queued_ms - self.prefill_compute_ms - self.kv_transfer_ms


async def generate(address: str, ids: list[int], max_tokens: int, mode: str) -> Sample:
    """One request through the router; the client TTFT is the first response with a token."""
    from pdserve.rpc import transport as gu
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    routes = {
        common_pb2.PREFILL_ROUTE_LOCAL: "local",
        common_pb2.PREFILL_ROUTE_REMOTE: "remote",
        common_pb2.PREFILL_ROUTE_FALLBACK: "fallback",
    }
    req = router_pb2.GenerateRequest(
        request_id=f"ttft-{uuid.uuid4().hex[:12]}",
        token_ids=router_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        latency_class=common_pb2.LATENCY_CLASS_STANDARD,
        return_timings=True,
    )
    async with gu.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await channel.channel_ready()  # the connection is not part of the request's latency
        sent = time.perf_counter()
        first: float | None = None
        route, timings = "?", None
        async for resp in stub.Generate(req, timeout=600):
            if resp.token_ids and first is None:
                first = time.perf_counter()
            route = routes.get(resp.route, route)
            if resp.finish_reason:
                if resp.error:
                    raise RuntimeError(f"request failed: {resp.error}")
                timings = resp.timings
    if first is None or timings is None:
        raise RuntimeError("the stream ended without a token or without timings")
    return Sample(
        mode=mode,
        route=route,
        prompt_tokens=len(ids),
        client_ttft_ms=(first - sent) * 1000,
        first_token_ms=timings.first_token_ms,
        queued_ms=timings.queued_ms,
        prefill_compute_ms=timings.prefill_compute_ms,
        kv_transfer_ms=timings.kv_transfer_ms,
        total_ms=timings.total_ms,
    )


def run_mode(args: argparse.Namespace, mode: str, rng: np.random.Generator) -> list[Sample]:
    from pdserve.cluster import LocalCluster

    threshold = LOCAL_THRESHOLD if mode == "local" else args.remote_threshold
    worker_args = (
        "--threads", str(len(args.decode_cores)),
        "--kv-cache-mb", str(args.kv_cache_mb),
        "--log-level", "WARNING",
        *MODES[mode][0],
    )  # fmt: skip
    cluster = LocalCluster(
        prefill=1,
        decode=1,
        model=args.model_path,
        extra_worker_args=worker_args,
        router_args=("--placement", "threshold",
                     "--remote-threshold", str(threshold), "--log-level", "WARNING",
                     "--no-admission", "--prefill-timeout", str(args.timeout),
                     "--transfer-timeout", str(args.timeout),
                     "--first-token-timeout", str(2 * args.timeout)),
        extra_prefill_args=(*MODES[mode][1], "--transfer-timeout", str(args.timeout)),
        extra_decode_args=("--max-alloc-lease", str(2 * args.timeout),
                           "--max-kv-wait", str(2 * args.timeout)),
        env={} if args.ucx_spin else dict(UCX_NO_SPIN_ENV),
    )
    samples = []
    with cluster:
        pin_process(cluster.procs["prefill-0"].pid, args.prefill_cores)
        pin_process(cluster.procs["decode-0"].pid, args.decode_cores)
        for length in args.lengths:
            for rep in range(-1, args.reps):  # rep -1: unmeasured warm-up
                ids = rng.integers(args.low_id, args.high_id, size=length).tolist()
                sample = asyncio.run(generate(cluster.grpc_address, ids, args.max_tokens, mode))
                if rep >= 0:
                    samples.append(sample)
                    print(f"{mode} {length}: {sample}", file=sys.stderr)
    return samples


def kv_bytes_per_token(model_path: str | None) -> int:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model_store import resolve_model

    model = ModelConfig.from_dir(resolve_model(model_path or "default", progress=False))
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import kv_layout

    layout = kv_layout(model, EngineConfig(block_size=1), "")  # the float32 pool's geometry
    return layout.block_nbytes


def table(samples: Sequence[Sample], kv_per_token: int) -> str:
    lines = [
        "| mode (route) | prompt tokens | n | client TTFT ms | router first token ms "
        "| prefill queue | prefill compute | KV transfer (after compute) | decode admission "
        "(rest) | KV MB | TTFT / compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.mode, s.prompt_tokens), []).append(s)
    for (mode, length), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):

        def mean(attr: str, group: list[Sample] = group) -> float:
            return float(np.mean([getattr(s, attr) for s in group]))

        routes = ",".join(sorted({s.route for s in group}))
        kv_mb = length * kv_per_token / 1e6
        if mode != "local":
            xfer = mean("kv_transfer_ms")
            compute = mean("prefill_compute_ms")
            stages = (
                f"{mean('first_token_ms'):.0f} | {mean('queued_ms'):.1f} "
                f"| {compute:.0f} | {xfer:.1f} | {mean('admission_ms'):.1f} "
                f"| {kv_mb:.1f} | {mean('client_ttft_ms') / compute:.3f}"
            )
        else:
            stages = "n/a | - | (on the decode worker) | - | - | - | -"
        lines.append(
            f"| {mode} ({routes}) | {length} | {len(group)} | {mean('client_ttft_ms'):.0f} "
            f"(min {min(s.client_ttft_ms for s in group):.0f}) | {stages} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_ttft", description=__doc__)
    p.add_argument("--lengths", type=_ints, default=(512, 2048), help="prompt lengths")
    p.add_argument("--reps", type=int, default=3, help="measured requests per length and mode")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool of each worker")
    p.add_argument("--remote-threshold", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="the router's prefill, transfer and first-token timeouts and the "
                   "decode worker's allocation lease and KV wait (an 8k prompt on one core "
                   "takes longer than their defaults)")
    p.add_argument("--prefill-cores", type=_ints, default=(0,))
    p.add_argument("--decode-cores", type=_ints, default=(1,))
    p.add_argument("--model-path", default=None, help="default: the default model")
    p.add_argument("--modes", default="remote,local",
                   help="comma-separated, of: remote (the default cluster: same-host KV path, "
                   "KV sent while the prompt computes), remote-after (--no-kv-overlap: KV sent "
                   "after), remote-ucx / remote-ucx-after (--no-kv-shm: over UCX), local "
                   "(prefilled on the decode worker)")
    p.add_argument("--low-id", type=int, default=1000, help="prompt token ids are drawn from")
    p.add_argument("--high-id", type=int, default=40000, help="[low-id, high-id)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ucx-spin", action="store_true", help="keep ucxx's busy-waiting default")
    p.add_argument("--out", type=Path, help="also write the samples as JSON here")
    args = p.parse_args(argv)
    if len(args.prefill_cores) != len(args.decode_cores):
        p.error("--prefill-cores and --decode-cores need as many cores each (one --threads)")
    rng = np.random.default_rng(args.seed)
    load_before = loadavg()
    samples: list[Sample] = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r} (one of {', '.join(MODES)})")
        samples += run_mode(args, mode, rng)
    info = {**machine_info(), "loadavg_before": load_before, "loadavg_after": loadavg()}
    print(f"command: python -m bench.bench_ttft {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"machine: {info}")
    print(
        f"prefill worker on CPU {args.prefill_cores}, decode worker on CPU {args.decode_cores}, "
        f"--threads {len(args.decode_cores)} each, --kv-cache-mb {args.kv_cache_mb}, "
        f"max_tokens {args.max_tokens}, means of {args.reps} requests (after 1 warm-up), "
        f"worker env { ({} if args.ucx_spin else UCX_NO_SPIN_ENV) }\n"
    )
    print(table(samples, kv_bytes_per_token(args.model_path)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": info, "samples": [asdict(s) for s in samples]}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
