"""The same prefill again and again on one idle core: how much does it vary, and is it steal? (stop 72)"""
import random, time, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_store import resolve_model
from pdserve.types import GenerateRequest, SamplingParams
torch.set_num_threads(1)
engine = LLMEngine.from_dir(resolve_model(None, progress=False), EngineConfig(
    kv_cache_bytes=512 << 20, max_num_batched_tokens=2048, max_prefill_chunk=512,
    num_threads=1, step_target_ms=0.0))
rng = random.Random(0)
def steal():
    for line in open("/proc/stat"):
        if line.startswith("cpu1 "):
            return int(line.split()[8])
def run(n):
    ids = tuple(rng.randrange(100, 40000) for _ in range(n))
    engine.add_request(GenerateRequest(f"r{rng.random()}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    s0 = steal(); c0 = time.process_time(); t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1000, (time.process_time() - c0) * 1000, steal() - s0
for _ in range(3): run(64)
for i in range(40):
    wall, cpu, st = run(96)
    print(f"96 tokens: wall {wall:.1f} ms, cpu {cpu:.1f} ms, steal {st * 10} ms")
