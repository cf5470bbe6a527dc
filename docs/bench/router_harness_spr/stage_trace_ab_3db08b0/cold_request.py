"""The router servicer's request building (`RouterServicer._request`) for 1,500-id prompts,
timed in a loop (hot) and after sweeping 8 or 64 MiB of memory before each call (cold).
python cold_request.py (PYTHONPATH = the repository)."""

import asyncio
import random
import time

import numpy as np

from pdserve.tenants import Tenants
from pdserve.v1 import common_pb2, router_pb2
from router.servicer import RouterServicer


class _Router:
    max_model_len = 8192
    tokenizer = None


async def main() -> None:
    servicer = RouterServicer(_Router(), Tenants())  # type: ignore[arg-type]
    tenant = servicer.tenants.identify("")
    assert tenant is not None
    rng = random.Random(1)
    reqs = [router_pb2.GenerateRequest(
        request_id=f"r{i}",
        token_ids=router_pb2.TokenIds(ids=[rng.randrange(49152) for _ in range(1500)]),
        sampling=common_pb2.SamplingParams(max_tokens=1)) for i in range(200)]
    big = np.ones(64 * 1024 * 1024 // 8)
    for mode in ("hot", "cold8M", "cold64M", "hot"):
        ts = []
        for i, r in enumerate(reqs):
            if mode.startswith("cold"):
                big[: int(mode[4:-1]) * 1024 * 1024 // 8] += 1.0  # sweep the caches
            t0 = time.perf_counter()
            await servicer._request(r, f"l{i}", tenant)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(mode, f"p50 {ts[len(ts) // 2] * 1e6:.1f} us p90 {ts[int(len(ts) * .9)] * 1e6:.1f}")


asyncio.run(main())
