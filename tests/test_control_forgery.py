"""A forged control plane on a live cluster (issue 21, item 1): real router, prefill and decode
processes with a cluster secret, real Redis, gRPC and UCX.

A rogue process with write access to Redis registers a "decode worker" and a "prefill worker"
(unsigned, and signed under another secret), both idle and serving the right model, and
rewrites the real decode worker's KV descriptor to point at its own listener. Requests keep
being served token for token as before, and the rogue receives nothing: no gRPC call (so no
prompt token, no request and no cluster token) and no connection to its KV listener.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from pdserve.client import RouterClient, Sampling
from pdserve.cluster import LocalCluster
from pdserve.control import WorkerInfo, WorkerLoad
from pdserve.control.signing import signer_for
from pdserve.engine.model_store import model_id
from pdserve.rpc.auth import ClusterSecret
from tests.helpers.cluster_util import cluster_fixture

pytestmark = pytest.mark.timeout(600)

SECRET = f"forgery-test-secret-{uuid.uuid4().hex}"
PROMPT = "Tell me about the history of the printing press in Europe. " * 6  # remote prefill
SHORT = "Say hi."


cluster = cluster_fixture(kv_cache_mb=128, cluster_secret=SECRET,
                          router_args=("--placement", "threshold", "--remote-threshold", "16"))


class _Trap(grpc.GenericRpcHandler):
    """A gRPC server that answers nothing and remembers every call it was offered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        self.calls.append((handler_call_details.method,
                           tuple(handler_call_details.invocation_metadata or ())))
        return None  # UNIMPLEMENTED


async def _complete(cluster: LocalCluster, text: str) -> tuple[str, list[int]]:
    async with RouterClient(cluster.grpc_address) as client:
        done = await client.complete(text=text, sampling=Sampling(max_tokens=12))
    return done.route, list(done.token_ids)


async def test_a_forged_control_plane_receives_nothing(cluster: LocalCluster,
                                                       model_dir: Path) -> None:
    before = [await _complete(cluster, PROMPT), await _complete(cluster, SHORT)]
    assert before[0][0] == "remote"

    trap = _Trap()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((trap,))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    kv_connections: list[int] = []

    async def on_kv(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kv_connections.append(len(await reader.read(1 << 16)))
        writer.close()

    kv_trap = await asyncio.start_server(on_kv, "127.0.0.1", 0)
    kv_addr = f"127.0.0.1:{kv_trap.sockets[0].getsockname()[1]}"
    ns = cluster.namespace
    prefix = f"pdserve:{ns}:"
    mid = model_id(model_dir)
    attacker = signer_for(ClusterSecret(b"the-attackers-own-secret-" + uuid.uuid4().hex.encode()),
                          ns)
    assert attacker is not None
    r = aioredis.Redis.from_url(str(cluster.redis_url))
    try:
        for n, role in enumerate(("decode", "prefill", "decode", "prefill")):
            wid = f"rogue-{role}-{n}"
            info = WorkerInfo(worker_id=wid, role=role,  # type: ignore[arg-type]
                              grpc_address=f"127.0.0.1:{grpc_port}", model_id=mid, epoch=1,
                              started_at=time.time(),
                              ucx_address=kv_addr if role == "decode" else "",
                              descriptor_id=f"{wid}:1" if role == "decode" else "",
                              load=WorkerLoad(free_blocks=10_000, total_blocks=10_000))
            raw = (info.to_json() if n < 2
                   else attacker.sign_json("worker", json.loads(info.to_json()), timestamp=True))
            await r.set(f"{prefix}worker:{wid}", raw, px=600_000)
            await r.sadd(f"{prefix}workers", wid)
            if role == "decode":
                desc = {"descriptor_id": f"{wid}:1", "worker_id": wid, "epoch": 1,
                        "ucx_address": kv_addr}
                await r.set(f"{prefix}kvdesc:{wid}:1", json.dumps(desc), px=600_000)
        # The real decode worker's descriptor, rewritten to point at the trap.
        for key in await r.keys(f"{prefix}kvdesc:*"):
            if b"rogue" in key:
                continue
            desc = json.loads(await r.get(key))
            desc["ucx_address"] = kv_addr
            await r.set(key, json.dumps(desc), keepttl=True)
        await asyncio.sleep(1.5)  # a few directory polls of router and workers

        after = [await _complete(cluster, PROMPT) for _ in range(3)]
        after += [await _complete(cluster, SHORT) for _ in range(3)]
        for _route, ids in after[:3]:
            assert ids == before[0][1]  # remote or, if the KV path broke, local: same tokens
        for _route, ids in after[3:]:
            assert ids == before[1][1]
        await asyncio.sleep(0.5)
        assert trap.calls == [], f"the rogue worker was called: {trap.calls[:3]}"
        assert kv_connections == [], "the rogue KV listener was dialled"
        # Nobody lists the rogue: the router's own view has the two real workers only.
        log = (cluster.log_dir / "router.log").read_text(errors="replace")
        assert "control_record_refused" in log
    finally:
        await r.aclose()
        kv_trap.close()
        await server.stop(None)
