"""Stream a completion from a pdserve router over gRPC.

    python examples/grpc_client.py --router 127.0.0.1:PORT "Once upon a time"

Text goes to stdout as it arrives; the finish reason, usage and (with --timings) the stage
timings go to stderr. Exits 1 with the error's stable code when the request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from pdserve.errors import PdserveError
from pdserve.rpc import convert, errors, transport
from pdserve.rpc.metadata import request_id_metadata
from pdserve.rpc.tls import TLSConfig, load_tls
from pdserve.types import LatencyClass, SamplingParams
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc


async def generate(
    target: str,
    prompt: str,
    sampling: SamplingParams,
    latency_class: LatencyClass,
    *,
    request_id: str = "",
    timings: bool = False,
    tls: TLSConfig | None = None,
) -> router_pb2.GenerateResponse:
    """Stream `prompt`'s completion to stdout; returns the last response."""
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        text=prompt,
        sampling=convert.sampling_to_proto(sampling),
        latency_class=convert.latency_to_proto(latency_class),
        return_timings=timings,
    )
    metadata = request_id_metadata(request_id) if request_id else ()
    last = router_pb2.GenerateResponse()
    async with transport.channel(target, tls=tls) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with errors.translate_rpc_errors():
            async for response in stub.Generate(request, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
    sys.stdout.write("\n")
    return last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--router", required=True, help="HOST:PORT of the router's gRPC server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--latency-class", default="standard", help="interactive|standard|batch")
    parser.add_argument("--request-id", default="", help="sent as the request id and x-request-id")
    parser.add_argument("--timings", action="store_true", help="print stage timings to stderr")
    parser.add_argument("--tls-cert", help="client certificate, for a router on TLS")
    parser.add_argument("--tls-key", help="its private key (mode 600)")
    parser.add_argument("--tls-ca", help="CA certificate the router's must chain to")
    args = parser.parse_args()
    tls = (load_tls(args.tls_cert, args.tls_key, args.tls_ca)
           if args.tls_cert and args.tls_key and args.tls_ca else None)

    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        last = asyncio.run(
            generate(
                args.router,
                args.prompt,
                sampling,
                LatencyClass.parse(args.latency_class),
                request_id=args.request_id,
                timings=args.timings,
                tls=tls,
            )
        )
    except (PdserveError, TimeoutError) as exc:
        code = getattr(exc, "code", "timeout")
        print(f"error [{code}]: {exc}", file=sys.stderr)
        return 1

    reason = common_pb2.FinishReason.Name(last.finish_reason)
    usage = last.usage
    print(
        f"[{last.request_id}] {reason} prompt={usage.prompt_tokens} "
        f"completion={usage.completion_tokens} cached={usage.cached_tokens} "
        f"route={common_pb2.PrefillRoute.Name(last.route)}",
        file=sys.stderr,
    )
    if last.error:
        print(f"error: {last.error}", file=sys.stderr)
    if args.timings and last.HasField("timings"):
        for name, ms in dataclasses.asdict(convert.stage_timings_from_proto(last.timings)).items():
            if ms is not None:  # kv_bytes is not on the wire
                print(f"  {name:>22} {ms:9.2f} ms", file=sys.stderr)
    return 1 if last.error else 0


if __name__ == "__main__":
    sys.exit(main())
