"""End a finished one-message stream by cancelling it, or by awaiting its status.

    python stream_end_cancel_vs_status.py cancel code cancel code

One process: a grpc.aio DecodeWorker server whose Generate yields one TokenChunk, and a
client that reads it and then cancels the call ("cancel") or awaits call.code() first
("code"); 8 concurrent calls x 400 rounds after 200 warm-up calls; process CPU and wall
time per call.
"""

import asyncio
import sys
import time

import grpc

from pdserve.v1 import decode_pb2, decode_pb2_grpc


class S(decode_pb2_grpc.DecodeWorkerServicer):
    async def Generate(self, request, context):
        yield decode_pb2.TokenChunk(token_id=1)


async def main(mode: str, n: int) -> None:
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeWorkerServicer_to_server(S(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = decode_pb2_grpc.DecodeWorkerStub(ch)
    req = decode_pb2.DecodeGenerateRequest()

    async def one() -> None:
        call = stub.Generate(req)
        await call.read()
        if mode == "code":
            async with asyncio.timeout(5):
                await call.code()
        call.cancel()

    for _ in range(200):
        await one()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await asyncio.gather(*(one() for _ in range(8)))
    c1, t1 = time.process_time(), time.perf_counter()
    print(mode, f"cpu/call {(c1 - c0) / (n * 8) * 1e6:.0f} us  "
          f"wall/call {(t1 - t0) / (n * 8) * 1e6:.0f} us")
    await ch.close()
    await server.stop(None)


for m in sys.argv[1:]:
    asyncio.run(main(m, 400))
