"""Network faults between real processes (issue 11): a prefill worker in its own network
namespace, reached over a veth pair the test creates, with a slow and lossy link (tc htb)
and a link taken down.

Layout (addresses are a random 10.213.x.y/30 made here; nothing else is touched):

    root namespace: redis-server, router (127.0.0.1), decode worker (gRPC on H, UCX on any)
         H = 10.213.x.(4k+1) on veth "pdXXXXXXa"
              |  veth pair (tc shaping here, both ends)
         W = 10.213.x.(4k+2) on veth "pdXXXXXXb"
    namespace "pdnsXXXXXX": prefill worker (gRPC and UCX on W), Redis via H

Workers run UCX over TCP on their veth only (UCX_TLS=tcp, UCX_NET_DEVICES), so KV bytes cross
the veth like they would cross a network (not shared memory). Needs root and `ip netns`;
skips otherwise. The phases share one cluster to keep the added CI time near 2 minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import MAX_NEW_TOKENS
from tests.helpers.cluster_util import generate, wait_blocks_free
from tests.helpers.netfault import NetCluster, Veth, make_veth, router_workers, until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# The router's remote-prefill deadline (RouterConfig.prefill_timeout_s): a request caught by
# a KV-path partition falls back to local prefill once it fires.
PREFILL_DEADLINE_S = 30.0


@pytest.fixture
def veth() -> Iterator[Veth]:
    with make_veth() as v:
        yield v


PROMPTS_USED = (0, 2, 4)


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompt_ids: list[list[int]]) -> dict[int, list[int]]:
    """Greedy transformers output for the short prompts used here (the session's
    `hf_reference` also runs the 1,000-token prompt, which this test does not need)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              local_files_only=True)
    out = {}
    with torch.inference_mode():
        for i in PROMPTS_USED:
            x = torch.tensor([prompt_ids[i]])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS,
                            do_sample=False)
            out[i] = y[0, x.shape[1]:].tolist()
    return out


async def test_prefill_worker_behind_a_faulty_link(veth: Veth, tmp_path: Path, model_dir: Path,
                                                   prompt_ids: list[list[int]],
                                                   reference: dict[int, list[int]]) -> None:
    c = NetCluster(veth, tmp_path, model_dir)
    W = veth.ns_ip
    router = c.router
    try:
        c.start([("decode", "decode-0", False), ("prefill", "prefill-0", True)],
                router_args=("--placement", "threshold", "--remote-threshold", "1"))
        await c.wait_ready()
        prefill_port, redis_port = c.ports["prefill-0"], c.redis_port
        roles = {w["worker_id"]: w for w in await router_workers(c.http)}
        assert roles["prefill-0"]["grpc_address"].startswith(W), roles  # over the veth
        report: list[str] = []

        async def ask(i: int, phase: str, routes: set[str]) -> float:
            start = time.monotonic()
            res = await generate(router, prompt_ids[i], MAX_NEW_TOKENS, deadline_s=120)
            took = time.monotonic() - start
            assert res.tokens == reference[i], f"{phase}: wrong output ({res.route})"
            assert res.route in routes, f"{phase}: route {res.route}, expected {routes}"
            report.append(f"{phase}: prompt {i} {res.route} {took:.1f}s")
            return took

        # 1. Healthy link: remote prefill, KV over the veth.
        await ask(0, "baseline", {"remote"})

        # 2. A slow link on every path (gRPC, Redis, UCX): 2 Mbit/s each way, packets queued
        # (delayed) behind each other. Still remote, still correct.
        veth.shape("2mbit", 1000)
        await ask(2, "slow link 2 Mbit/s", {"remote"})
        veth.clear()

        # 3. The KV path starved (8 kbit/s, a 2-packet queue: nearly every packet dropped) on
        # all but gRPC and Redis: the prefill worker computes but its KV does not land in time;
        # the router's remote deadline fires and it prefills locally on the decode worker.
        veth.shape("8kbit", 2, exempt_ports=(prefill_port, redis_port))
        took = await ask(4, "UCX path starved and lossy", {"fallback"})
        assert took < PREFILL_DEADLINE_S + 60
        veth.clear()
        await ask(0, "after UCX loss healed", {"remote", "fallback"})

        # 4. Link down (everything partitioned): the prefill worker's lease lapses, the router
        # drops it and serves locally; once the link is back the worker re-registers.
        veth.link(False)
        gone = await until(lambda: _count(c, 1), 60, "partitioned prefill dropped")
        report.append(f"link down: prefill dropped from the router after {gone:.1f}s")
        await ask(2, "link down", {"local"})
        veth.link(True)
        back = await until(lambda: _count(c, 2), 60, "prefill back")
        report.append(f"link up: prefill listed again after {back:.1f}s")
        remote_again = None
        start = time.monotonic()
        routes: list[str] = []
        while remote_again is None and time.monotonic() - start < 90:
            res = await generate(router, prompt_ids[0], MAX_NEW_TOKENS, deadline_s=120)
            assert res.tokens == reference[0], f"after link up: wrong output ({res.route})"
            routes.append(f"{res.route} at {time.monotonic() - start:.1f}s")
            if res.route == "remote":
                remote_again = time.monotonic() - start
        assert remote_again is not None, (
            f"remote prefill never came back: {routes}\n" + "\n".join(report)
            + "\n" + c.procs.warnings())
        report.append(f"link up: remote prefill again {remote_again:.1f}s after it was listed")

        # No KV block leaked on either worker.
        for wid, addr in c.addresses.items():
            role = wid.split("-")[0]
            free, total = await wait_blocks_free(addr, role, timeout_s=30)
            assert free == total, f"{role}: {free}/{total} blocks free"
            report.append(f"{role}: {free}/{total} blocks free")
        print("\n" + "\n".join(report))
    finally:
        veth.clear()
        c.close()


async def _count(c: NetCluster, n: int) -> bool:
    return len(await c.listed()) == n
