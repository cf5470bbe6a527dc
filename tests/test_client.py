"""The typed asyncio client (`pdserve.client`, also shipped alone by clients/python): it
imports nothing heavy; naming several replicas, it sends again a stream that failed before
its first response reached the caller; and against a real cluster it streams the same tokens
as a raw stub call, collects completions, maps failures to RouterError with the stable code,
and aborts."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve import client as client_module
from pdserve.client import RouterClient, RouterError, Sampling
from pdserve.cluster import LocalCluster
from pdserve.rpc import transport
from pdserve.v1 import router_pb2, router_pb2_grpc
from tests.helpers.cluster_util import cluster_fixture, generate

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def test_client_imports_only_grpc_and_protobuf() -> None:
    code = ("import sys, pdserve.client\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ucxx', 'numpy', 'transformers', 'structlog', 'redis', 'fastapi') "
            "or m.startswith(('pdserve.engine', 'router', 'pdserve.rpc')))\n"
            "print(heavy)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_client_distribution_takes_its_files_from_the_repository() -> None:
    setup = (ROOT / "clients" / "python" / "setup.py").read_text()
    assert '"pdserve" / "client.py"' in setup and '"protos"' in setup
    meta = (ROOT / "clients" / "python" / "pyproject.toml").read_text()
    deps = meta.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert sorted(line.split(">")[0].strip(' "') for line in deps.strip().splitlines()) == \
        ["grpcio", "protobuf"]


cluster = cluster_fixture(prefill=0, kv_cache_mb=64)


async def test_typed_client_against_a_cluster(cluster: LocalCluster,
                                              prompt_ids: list[list[int]]) -> None:
    ids = prompt_ids[0][:40]
    reference = await generate(cluster.grpc_address, ids, max_tokens=8)
    async with RouterClient(cluster.grpc_address) as client:
        chunks = [c async for c in client.generate(token_ids=ids,
                                                   sampling=Sampling(max_tokens=8))]
        assert [t for c in chunks for t in c.token_ids] == reference.tokens
        assert chunks[-1].finish_reason in ("stop", "length")
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].usage.prompt_tokens == len(ids)
        assert chunks[-1].route == "local" and chunks[-1].decode_worker == "decode-0"

        done = await client.complete(messages=[("user", "Say hi.")],
                                     sampling=Sampling(max_tokens=4), request_id="client-1")
        assert done.request_id == "client-1" and done.text
        assert done.usage.completion_tokens == len(done.token_ids) <= 4

        with pytest.raises(RouterError) as info:
            await client.complete(token_ids=ids, sampling=Sampling(max_tokens=1 << 20))
        assert info.value.status == "INVALID_ARGUMENT"
        assert info.value.code == "context_length_exceeded", info.value

        assert await client.abort("no-such-request") is False
        with pytest.raises(ValueError):
            await client.complete(text="a", token_ids=[1])


class _FlakyRouter(router_pb2_grpc.RouterServicer):
    """A router whose first call (over every replica sharing `calls`) fails UNAVAILABLE after
    `before_failing` responses, its response headers already sent: what a client sees when a
    router is killed as it writes a stream's first response. Later calls stream "ok"."""

    def __init__(self, calls: list[str], name: str, before_failing: int) -> None:
        self.calls, self.name, self.before_failing = calls, name, before_failing

    async def Generate(self, request: router_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        self.calls.append(self.name)
        if len(self.calls) == 1:
            await context.send_initial_metadata(())
            for i in range(self.before_failing):
                yield router_pb2.GenerateResponse(request_id="r", token_ids=[i])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        for i, ch in enumerate("ok"):
            yield router_pb2.GenerateResponse(request_id="r", token_ids=[100 + i], text=ch)


@contextlib.asynccontextmanager
async def _replicas(before_failing: int) -> AsyncIterator[tuple[list[str], list[str]]]:
    """Two real routers on loopback sharing one call log: (their addresses, the log)."""
    calls: list[str] = []
    servers, addresses = [], []
    for name in ("a", "b"):
        srv = transport.new_server()
        router_pb2_grpc.add_RouterServicer_to_server(_FlakyRouter(calls, name, before_failing),
                                                     srv)
        addresses.append(f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}")
        await srv.start()
        servers.append(srv)
    try:
        yield addresses, calls
    finally:
        for srv in servers:
            await srv.stop(None)


async def test_replicas_client_resends_a_stream_that_failed_before_its_first_response(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose router answered with headers and then UNAVAILABLE, nothing yet yielded
    to the caller: gRPC's own retry has committed to that call and gives up; the client sends
    the stream again. One that had yielded a response is not sent again."""
    async with _replicas(before_failing=0) as (addresses, calls):
        async with RouterClient(addresses, timeout_s=10) as client:
            done = await client.complete(token_ids=[1, 2])
        assert done.text == "ok" and len(calls) == 2, calls

    # Without the client's own attempts, the call fails: gRPC did not retry it.
    monkeypatch.setattr(client_module, "_STREAM_ATTEMPTS", 1)
    async with _replicas(before_failing=0) as (addresses, calls):
        async with RouterClient(addresses, timeout_s=10) as client:
            with pytest.raises(RouterError) as info:
                await client.complete(token_ids=[1, 2])
        assert info.value.status == "UNAVAILABLE" and len(calls) == 1, (info.value, calls)
    monkeypatch.undo()

    async with _replicas(before_failing=1) as (addresses, calls):
        async with RouterClient(addresses, timeout_s=10) as client:
            seen: list[int] = []
            with pytest.raises(RouterError) as info:
                async for chunk in client.generate(token_ids=[1, 2]):
                    seen.extend(chunk.token_ids)
        assert info.value.status == "UNAVAILABLE" and seen == [0] and len(calls) == 1, calls


async def test_a_list_of_one_host_name_is_every_replica_it_resolves_to() -> None:
    """``RouterClient(["name:port"])``: a DNS name for the replicas (a headless Service), with
    the replicas' load spreading and the client's own second attempt."""
    assert client_module.replicas_target(["pdserve-router:50051"]) == "dns:///pdserve-router:50051"
    with pytest.raises(ValueError):
        client_module.replicas_target(["pdserve-router:50051", "10.0.0.2:50051"])
    async with _replicas(before_failing=0) as (addresses, calls):
        port = addresses[0].rpartition(":")[2]
        async with RouterClient([f"localhost:{port}"], timeout_s=10) as client:
            done = await client.complete(token_ids=[1, 2])
        assert done.text == "ok" and calls == ["a", "a"], calls
