"""One engine alone (prefix cache off): a 1,146-token prompt prefilled four times on
`sys.argv[1]` torch threads, after a warm-up (stop 74: does a second thread speed prefill?).
Reformatted for ruff after engine_prefill_threads_f9f4a46.txt was made; same steps."""

import random
import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams

t = int(sys.argv[1])
torch.set_num_threads(t)
engine = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
    kv_cache_bytes=512 << 20, max_num_batched_tokens=2048, max_prefill_chunk=512,
    num_threads=t, step_target_ms=0.0, enable_prefix_caching=False))
rng = random.Random(0)


def run(n: int) -> float:
    ids = tuple(rng.randrange(100, 40000) for _ in range(n))
    engine.add_request(GenerateRequest(f"r{rng.random()}", ids,
                                       SamplingParams(max_tokens=1, ignore_eos=True)))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


run(64)
run(512)
xs = [run(1146) for _ in range(4)]
print("threads", t, "torch threads", torch.get_num_threads(), "1146-token prefill s",
      [round(x, 2) for x in xs], flush=True)
