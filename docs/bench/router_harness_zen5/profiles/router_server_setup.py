"""Latency of the router's gRPC server setup against a bare grpc.aio server.

    python router_server_setup.py client

A server process pinned to CPU 0 (bare: `grpc.aio.server()`; ours_noauth:
`transport.new_server(max_concurrent_rpcs=1024)`; ours: that with the API key interceptor)
serves Router.Generate answering one message; this process, pinned to CPU 1, sends one
1,500-id request at a time: TTFT p50/p90 in ms over 1,000 requests (after 100), three rounds.
"""

import asyncio
import os
import subprocess
import sys
import time

import grpc

from pdserve.rpc import transport
from pdserve.rpc.auth import api_key_interceptor
from pdserve.v1 import router_pb2, router_pb2_grpc

KEY = "k" * 32
KINDS = ("bare", "ours_noauth", "ours")


class S(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])


async def serve(kind: str, port: int) -> None:
    if kind == "bare":
        server = grpc.aio.server()
    elif kind == "ours_noauth":
        server = transport.new_server(max_concurrent_rpcs=1024)
    else:
        server = transport.new_server(auth=api_key_interceptor([KEY]),
                                      max_concurrent_rpcs=1024)
    router_pb2_grpc.add_RouterServicer_to_server(S(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def client(port: int, n: int) -> tuple[float, float]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.RouterStub(ch)
    md = (("authorization", f"Bearer {KEY}"),)
    req = router_pb2.GenerateRequest(request_id="x",
                                     token_ids=router_pb2.TokenIds(ids=list(range(1500))))
    out = []
    for i in range(n + 100):
        t = time.perf_counter()
        async for _ in stub.Generate(req, metadata=md):
            if i >= 100:
                out.append((time.perf_counter() - t) * 1e3)
    await ch.close()
    out.sort()
    return out[len(out) // 2], out[int(len(out) * 0.9)]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        asyncio.run(serve(sys.argv[2], int(sys.argv[3])))
    else:
        os.sched_setaffinity(0, {1})
        res: dict[str, list[tuple[float, float]]] = {}
        for rnd in range(3):
            for kind in KINDS:
                port = 30000 + rnd * 10 + KINDS.index(kind)
                p = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "serve",
                                      kind, str(port)], stdout=subprocess.PIPE, text=True)
                assert p.stdout is not None
                p.stdout.readline()
                res.setdefault(kind, []).append(asyncio.run(client(port, 1000)))
                p.kill()
                p.wait()
        for k, v in res.items():
            print(k, [f"{a:.3f}/{b:.3f}" for a, b in v])
