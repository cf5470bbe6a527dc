"""A real prefill worker (`run_prefill`: the model, its engine, Redis) publishes its prefix
cache's KV events like a decode worker, and a real Router follows them into its index: what
the prefill worker computed is then known to the router without asking it, and cost
placement charges that worker only the tokens its cache lacks."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from pdserve.control.load import WorkerLoad
from pdserve.control.registry import WorkerRegistry
from pdserve.control.workers import WorkerInfo
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.types import GenerateRequest, LatencyClass, SamplingParams
from prefill_svc.main import PrefillConfig, run_prefill
from router.clients import WorkerChannels
from router.placement import place
from router.policy import Route, RouterPolicy
from router.router import Router


async def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_prefill_workers_cache_reaches_the_routers_index(
        redis_server: str, model_dir: Path, tokenizer: Any) -> None:
    namespace = f"pkv{uuid.uuid4().hex[:8]}"
    config = PrefillConfig(worker_id="prefill-0", redis_url=redis_server, model=str(model_dir),
                           engine=EngineConfig(kv_cache_bytes=32 << 20), metrics_port=-1,
                           namespace=namespace, drain_timeout_s=5.0)
    stop, ready = asyncio.Event(), asyncio.Event()
    worker = asyncio.create_task(run_prefill(config, stop, ready))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, worker], timeout=600, return_when=asyncio.FIRST_COMPLETED)
        if worker.done():
            worker.result()  # raises what stopped it
        assert ready.is_set(), "the prefill worker did not start"
        max_model_len = ModelConfig.from_dir(model_dir).max_position_embeddings
        async with (WorkerRegistry.from_url(redis_server, namespace=namespace) as registry,
                    Router(registry, tokenizer, model_name=model_dir.name,
                           max_model_len=max_model_len, poll_s=0.1) as router):
            await _until(lambda: router.workers("prefill"), 30, "the router to list it")
            [info] = router.workers("prefill")
            index = router.kv_index
            await _until(lambda: index.synced(info.worker_id), 30, "its opening snapshot")
            bs = index.block_size(info.worker_id)
            assert bs is not None
            extra = info.model_id.encode()
            ids = [100 + (i * 7919) % 30000 for i in range(5 * bs + 3)]  # 5 full blocks
            assert index.match_prompt(ids, bs, extra) == {}

            channels = WorkerChannels()
            try:  # the prefill alone (no destination): the KV stays in its cache
                report = await channels.prefill(info).prefill(
                    GenerateRequest("r1", tuple(ids), SamplingParams(max_tokens=1)), None,
                    timeout_s=120.0)
            finally:
                await channels.close()
            assert report.num_computed_tokens == len(ids)
            await _until(lambda: index.match_prompt(ids, bs, extra).get(info.worker_id) == 5,
                         30, "the stored blocks to reach the index")

            # Cost placement: a busy decode worker holding nothing, this prefill worker
            # holding 5 blocks of the prompt: remote, charged the 3 tokens it lacks.
            decode = WorkerInfo(worker_id="decode-x", role="decode", grpc_address="127.0.0.1:1",
                                model_id=info.model_id, epoch=1, started_at=time.time(),
                                load=WorkerLoad(running=8, prefill_tokens_per_s=500.0,
                                                decode_step_s=0.05))
            p = place(ids, LatencyClass.STANDARD, [decode], router.workers("prefill"), index,
                      {}, RouterPolicy(placement="cost"),
                      cost=router.config.cost)
            assert p.decision.route is Route.REMOTE and p.prefill is not None
            assert p.prefill.worker_id == info.worker_id
            assert p.decision.uncached_tokens == len(ids) - 5 * bs
            assert p.cached_tokens == 0  # on the decode worker, which gets all of it sent
    finally:
        stop.set()
        await asyncio.gather(worker, return_exceptions=True)
