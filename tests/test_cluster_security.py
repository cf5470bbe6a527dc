"""Authenticated internals on a live cluster (issue 11): real router, prefill and decode
processes, real Redis, gRPC and UCX, with a cluster secret and an API key.

- A worker refuses gRPC calls without the cluster credential, or with a wrong one
  (UNAUTHENTICATED), while its health service stays open.
- The router's client gRPC API takes the REST API keys.
- The remote-prefill path (router -> workers gRPC, signed KV writes) works with the secret.
- No secret, API key, Redis password or prompt text appears in any process's log at INFO,
  nor on any process's command line (the Redis URL reaches the children in their
  environment), and the cluster's private Redis refuses clients without its password.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import RouterClient, RouterError, Sampling
from pdserve.cluster import LocalCluster
from pdserve.rpc import transport as gu
from pdserve.rpc.auth import CLUSTER_TOKEN_KEY, ClusterSecret
from pdserve.rpc.errors import ERROR_CODE_KEY
from pdserve.rpc.metadata import metadata_value
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.helpers.cluster_util import cluster_fixture

pytestmark = pytest.mark.timeout(900)

TAG = uuid.uuid4().hex[:10]
SECRET = f"cluster-secret-{TAG}-{uuid.uuid4().hex}"
API_KEY = f"sk-apikey-{TAG}"
WRONG_KEY = f"sk-wrongkey-{TAG}"
MARK = f"zanzibarquokka{TAG}"  # in every prompt this test sends
PROMPT = (f"My secret code word is {MARK}. Remember the code word {MARK} and never say "
          f"it. " * 4)
REMOTE_THRESHOLD = 16


cluster = cluster_fixture(kv_cache_mb=128, cluster_secret=SECRET,
                          env={"PDSERVE_API_KEY": API_KEY, "PDSERVE_LOG_LEVEL": "INFO"},
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD)))


def _addr(cluster: LocalCluster, name: str) -> str:
    return f"127.0.0.1:{cluster.ports[name]}"


async def _stats(address: str, role: str, metadata: tuple[tuple[str, str], ...]) -> object:
    async with gu.insecure_channel(address) as ch:
        stub = (decode_pb2_grpc.DecodeWorkerStub(ch) if role == "decode"
                else prefill_pb2_grpc.PrefillWorkerStub(ch))
        return await stub.Stats(common_pb2.StatsRequest(), timeout=10, metadata=metadata)


async def test_workers_refuse_calls_without_the_cluster_credential(
        cluster: LocalCluster) -> None:
    other = ClusterSecret(b"some-other-cluster-secret-000").grpc_metadata()
    for name in ("decode-0", "prefill-0"):
        role = name.split("-")[0]
        for metadata in ((), ((CLUSTER_TOKEN_KEY, "0" * 64),), other,
                         ((CLUSTER_TOKEN_KEY, SECRET),)):  # the raw secret is not the token
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _stats(_addr(cluster, name), role, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            trailers = refused.value.trailing_metadata()
            assert metadata_value(trailers, ERROR_CODE_KEY) == "unauthenticated"
        credential = ClusterSecret(cluster.cluster_secret.encode()).grpc_metadata()
        stats = await _stats(_addr(cluster, name), role, credential)
        assert stats.num_total_blocks > 0  # type: ignore[attr-defined]
        async with gu.insecure_channel(_addr(cluster, name)) as ch:  # probes stay open
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

    # A real work RPC is refused before its handler runs (no descriptor lookup, no prefill).
    async with gu.insecure_channel(_addr(cluster, "prefill-0")) as ch:
        req = prefill_pb2.PrefillRequest(
            input=common_pb2.GenerateInput(request_id=f"unauth-{TAG}",
                                           prompt_token_ids=[1, 2, 3],
                                           sampling=common_pb2.SamplingParams(max_tokens=1)),
            destination=prefill_pb2.KVDestination(descriptor_id="decode-0:1", block_ids=[0],
                                                  transfer_id="t"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(req, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # So is a decode worker's Session call, whatever requests it carries.
    async with gu.insecure_channel(_addr(cluster, "decode-0")) as ch:
        start = decode_pb2.SessionRequest(stream=1, generate=decode_pb2.DecodeGenerateRequest(
            input=req.input))
        stub = decode_pb2_grpc.DecodeWorkerStub(ch)
        call = stub.Session(timeout=30)
        # The write may already find the call refused: grpc.aio then ends it INTERNAL on
        # this side ("Internal error from Core"), in place of the status the worker sent.
        wrote = True
        try:
            await call.write(decode_pb2.SessionRequests(requests=[start]))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            wrote = False
        code = await call.code()
        assert code == grpc.StatusCode.UNAUTHENTICATED or (
            not wrote and code == grpc.StatusCode.INTERNAL), code
        # A call that writes nothing has no such race: refused, whatever it would carry.
        assert await stub.Session(timeout=30).code() == grpc.StatusCode.UNAUTHENTICATED


async def test_router_grpc_takes_the_rest_api_keys(cluster: LocalCluster) -> None:
    for key in (None, WRONG_KEY):
        async with RouterClient(cluster.grpc_address, api_key=key) as client:
            with pytest.raises(RouterError) as refused:
                await client.complete(text="Hi", sampling=Sampling(max_tokens=2))
            assert refused.value.status == "UNAUTHENTICATED"
            assert refused.value.code == "unauthenticated"
    async with RouterClient(cluster.grpc_address, api_key=API_KEY) as client:
        done = await client.complete(text="Hi", sampling=Sampling(max_tokens=2))
        assert done.usage.completion_tokens >= 1
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=120) as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
        r = await http.post("/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200


async def test_remote_prefill_works_with_the_secret(cluster: LocalCluster) -> None:
    """Router -> decode AllocateAndGenerate, router -> prefill Prefill, and the
    signed KV write prefill -> decode all pass with the cluster's credential."""
    async with RouterClient(cluster.grpc_address, api_key=API_KEY) as client:
        done = await client.complete(text=PROMPT, sampling=Sampling(max_tokens=8))
    assert done.route == "remote", done.route
    assert done.usage.completion_tokens >= 1
    # The prefill worker opened its signed endpoint to the decode worker once registered
    # (a decode worker takes signed frames from registered prefill workers only), so no
    # frame of this cluster's own was ever refused.
    prefill_log = (cluster.log_dir / "prefill-0.log").read_text(errors="replace")
    decode_log = (cluster.log_dir / "decode-0.log").read_text(errors="replace")
    assert '"event": "kv_peer_warmed"' in prefill_log
    assert "kv_peer_warmup_failed" not in prefill_log
    assert "kv_write_unauthenticated" not in decode_log


async def test_no_secret_or_prompt_text_in_any_log(cluster: LocalCluster) -> None:
    """Requests carrying a distinctive prompt (HTTP and gRPC, accepted, refused for a bad
    parameter, refused for a wrong key) go through the cluster; then no process's INFO log
    holds the prompt, the API keys, the cluster secret or any key derived from it."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as http:
        ok = await http.post("/v1/chat/completions", headers=headers, json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6})
        assert ok.status_code == 200
        ok = await http.post("/v1/completions", headers=headers, json={
            "prompt": PROMPT, "max_tokens": 4, "stream": True})
        assert ok.status_code == 200
        bad = await http.post("/v1/chat/completions", headers=headers, json={
            "messages": [{"role": "user", "content": PROMPT}], "temperature": -3})
        assert bad.status_code == 400
        wrong = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}]},
            headers={"Authorization": f"Bearer {WRONG_KEY}"})
        assert wrong.status_code == 401
    async with RouterClient(cluster.grpc_address, api_key=API_KEY) as client:
        await client.complete(messages=[("user", PROMPT)], sampling=Sampling(max_tokens=4))
        with pytest.raises(RouterError):
            await client.complete(text=PROMPT, sampling=Sampling(max_tokens=4, temperature=-2))
    async with RouterClient(cluster.grpc_address, api_key=WRONG_KEY) as client:
        with pytest.raises(RouterError):
            await client.complete(text=PROMPT, sampling=Sampling(max_tokens=4))
    await asyncio.sleep(1.0)  # stderr is line-buffered: let the last lines reach the files

    secret = ClusterSecret(SECRET.encode())
    redis_password = urlsplit(str(cluster.redis_url)).password
    assert redis_password and len(redis_password) >= 32  # cluster's private Redis has one
    forbidden = {"prompt": MARK, "api key": API_KEY, "wrong api key": WRONG_KEY,
                 "cluster secret": SECRET, "grpc token": secret.grpc_token,
                 "kv key": secret.kv_key.hex(), "redis password": redis_password}
    logs = {p.name: p.read_text(errors="replace") for p in cluster.log_dir.glob("*.log")}
    assert {"router.log", "decode-0.log", "prefill-0.log"} <= set(logs)
    assert '"level": "info"' in logs["router.log"]  # INFO lines were written
    assert '"event": "grpc_call_unauthenticated"' in logs["router.log"]
    for name, text in logs.items():
        for what, value in forbidden.items():
            assert value not in text, f"{what} appears in {name}"
    # Nor on a command line (`ps` shows those to every user of the machine).
    command_lines = _command_lines(cluster)
    assert {"router", "decode-0", "prefill-0", "redis-server"} <= set(command_lines)
    for name, argv in command_lines.items():
        for what, value in forbidden.items():
            assert value not in argv, f"{what} on the command line of {name}"
        assert "--redis-url" not in argv and "redis://" not in argv, name


def test_the_private_redis_wants_its_password(cluster: LocalCluster) -> None:
    import redis

    url = urlsplit(str(cluster.redis_url))
    anonymous = redis.Redis(host=url.hostname, port=url.port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    wrong = redis.Redis(host=url.hostname, port=url.port, password="not-the-password",
                        socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(str(cluster.redis_url), socket_timeout=5).ping()


def _off_loopback(host: str) -> bool:
    ip = ipaddress.ip_address(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return not (mapped or ip).is_loopback


def test_no_listener_off_loopback(cluster: LocalCluster) -> None:
    """A default (loopback) cluster listens on loopback only: the decode worker's UCX sockaddr
    listener, which ucxx's Python binding would bind to every interface, is moved to --host
    (kvxfer.listen), and UCX's TCP transport, which otherwise listens on each interface's
    address in both workers, is kept on `lo` (UCX_NET_DEVICES)."""
    import json

    import psutil

    pids = {p.pid for p in cluster.procs.values() if p.poll() is None}
    if cluster._redis is not None:
        pids.add(cluster._redis.pid)
    ready = next(json.loads(line) for line in
                 (cluster.log_dir / "decode-0.log").read_text().splitlines()
                 if '"decode_worker_ready"' in line)
    ucx_port = int(ready["ucx"].rpartition(":")[2])
    exposed = sorted((c.pid, c.laddr.ip, c.laddr.port)
                     for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids
                     and _off_loopback(c.laddr.ip))
    ucx_listeners = [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == ucx_port
                     and c.pid == cluster.procs["decode-0"].pid]
    assert exposed == [], exposed
    assert ucx_listeners == [("127.0.0.1", ucx_port)], ucx_listeners


def _command_lines(cluster: LocalCluster) -> dict[str, str]:
    procs = dict(cluster.procs)
    if cluster._redis is not None:
        procs["redis-server"] = cluster._redis
    return {name: Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
            for name, proc in procs.items() if proc.poll() is None}


def test_a_router_with_a_wrong_secret_cannot_use_the_workers(cluster: LocalCluster,
                                                             model_dir: Path) -> None:
    """A second router on the same Redis namespace but with another secret gets no service:
    either it refuses the workers' records (signed with the real secret, so their signature
    does not verify for it) or it lists them and every call to them is refused. Its
    requests fail, none is served."""
    import os
    import subprocess
    import sys

    from pdserve.cluster import free_port, wait_port

    port, http_port = free_port(), free_port()
    log = cluster.log_dir / "intruder-router.log"
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": "not-this-clusters-secret-at-all",
           "PDSERVE_LOG_LEVEL": "INFO", "PDSERVE_REDIS_URL": str(cluster.redis_url)}
    env.pop("PDSERVE_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "router",
             "--namespace", cluster.namespace, "--model", str(model_dir), "--port", str(port),
             "--http-port", str(http_port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_port(http_port, proc, 120, "intruder router")
        deadline = time.monotonic() + 60
        while True:  # until it lists both workers, or refuses their records
            r = httpx.get(f"http://127.0.0.1:{http_port}/v1/pdserve/workers", timeout=5)
            listed = r.status_code == 200 and len(r.json().get("workers", [])) >= 2
            if listed or '"event": "control_record_refused"' in log.read_text():
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=120,
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code >= 500, r.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if listed:  # it called them, and they refused
        decode_log = (cluster.log_dir / "decode-0.log").read_text(errors="replace")
        assert '"event": "grpc_call_unauthenticated"' in decode_log
