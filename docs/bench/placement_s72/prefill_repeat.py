"""One 96-token prompt prefilled 40 times on an idle core: how much does it vary, and is any
of it steal time? (stop 72; run with `taskset -c 1`, it reads CPU 1's steal counter)"""

import random
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams

torch.set_num_threads(1)
engine = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
    kv_cache_bytes=512 << 20, max_num_batched_tokens=2048, max_prefill_chunk=512,
    num_threads=1, step_target_ms=0.0))
rng = random.Random(0)


def steal() -> int:
    with open("/proc/stat") as f:
        return next(int(line.split()[8]) for line in f if line.startswith("cpu1 "))


def run(n: int) -> tuple[float, float, int]:
    ids = tuple(rng.randrange(100, 40000) for _ in range(n))
    engine.add_request(GenerateRequest(f"r{rng.random()}", ids,
                                       SamplingParams(max_tokens=1, ignore_eos=True)))
    s0, c0, t = steal(), time.process_time(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1000, (time.process_time() - c0) * 1000, steal() - s0


for _ in range(3):
    run(64)
for _ in range(40):
    wall, cpu, stolen = run(96)
    print(f"96 tokens: wall {wall:.1f} ms, cpu {cpu:.1f} ms, steal {stolen * 10} ms")
