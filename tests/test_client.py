"""The typed asyncio client (`pdserve.client`, also shipped alone by clients/python): it
imports nothing heavy, and against a real cluster it streams the same tokens as a raw stub
call, collects completions, maps failures to RouterError with the stable code, and aborts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.client import RouterClient, RouterError, Sampling
from pdserve.cluster import LocalCluster
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
