"""The compiled data plane with TLS on every hop (`pdserve cluster up --tls`'s layout: a
private CA, a certificate per process kind): the router's port serves TLS from grpc++, its
sessions to the decode worker and its relay to the grpc.aio server behind it are mTLS, and
outputs are transformers' greedy outputs."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router import dataplane
from tests.helpers.cluster_util import cluster_fixture
from tests.helpers.hf import hf_greedy

pytestmark = [
    pytest.mark.skipif(not dataplane.available(),
                       reason="router/_dataplane.cc not built (needs libgrpc++-dev)"),
    pytest.mark.timeout(600),
]

cluster = cluster_fixture(prefill=0, decode=1, kv_cache_mb=64, tls=True,
                          router_args=("--data-plane", "compiled"))


async def test_tls_on_every_hop(cluster, model_dir, prompt_ids) -> None:
    short = list(prompt_ids[0])
    want = hf_greedy(model_dir, [short], 8)[0]
    creds = cluster.grpc_credentials()
    async with grpc.aio.secure_channel(cluster.grpc_address, creds) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
        routed = [r async for r in stub.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=short), sampling=sampling), timeout=120)]
        assert [t for r in routed for t in r.token_ids] == want
        assert routed[-1].route == common_pb2.PREFILL_ROUTE_LOCAL
        # A text prompt: relayed, over mTLS, to the grpc.aio server behind the data plane.
        text = [r async for r in stub.Generate(router_pb2.GenerateRequest(
            text="The capital of France is", sampling=sampling), timeout=120)]
        assert sum(len(r.token_ids) for r in text) == 8
    # Plaintext is refused on the TLS port.
    async with grpc.aio.insecure_channel(cluster.grpc_address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                    token_ids=router_pb2.TokenIds(ids=short), sampling=sampling), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
