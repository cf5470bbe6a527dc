import time, random, asyncio
import numpy as np
from pdserve.v1 import router_pb2, common_pb2
from pdserve.tenants import Tenants
from router.servicer import RouterServicer
class R: max_model_len = 8192; tokenizer=None
sv = RouterServicer(R(), Tenants())
tenant = sv.tenants.identify("")
rng = random.Random(1)
reqs = [router_pb2.GenerateRequest(request_id=f"r{i}", token_ids=router_pb2.TokenIds(ids=[rng.randrange(49152) for _ in range(1500)]), sampling=common_pb2.SamplingParams(max_tokens=1)) for i in range(200)]
big = np.ones(64 * 1024 * 1024 // 8)
async def main():
    for mode in ("hot", "cold8M", "cold64M", "hot"):
        ts = []
        for i, r in enumerate(reqs):
            if mode.startswith("cold"):
                n = int(mode[4:-1]) * 1024 * 1024 // 8
                big[:n] += 1.0  # sweep caches
            t0 = time.perf_counter()
            await sv._request(r, f"l{i}", tenant)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(mode, f"p50 {ts[len(ts)//2]*1e6:.1f} us p90 {ts[int(len(ts)*.9)]*1e6:.1f}")
asyncio.run(main())
