"""TLS on every hop (issue 21 item 2), on real processes: a 1P1D cluster started the way
`pdserve cluster up --tls` starts it (a private CA, a certificate per process kind, mTLS
between the router and the workers) with a cluster secret and an API key.

- Its answers over gRPC (remote and local prefill) are the transformers reference's tokens,
  which the plaintext cluster's are too (test_cluster.py), and REST over HTTPS agrees.
- Plaintext is refused on every listener: the router's gRPC API and HTTP gateway, the
  workers' gRPC and metrics.
- The workers take only clients with a certificate from the cluster's CA (none, or one
  from another CA, is refused in the handshake); the client-facing listeners ask for a
  client certificate as --tls-client-auth says (none / require, in process).
- `pdserve certs` writes private files with the right names and uses; keys that are not
  private, and certificates that do not match their key, are refused.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.certs import make_local_pki
from pdserve.cli import main as cli_main
from pdserve.client import RouterClient, RouterError, Sampling, tls_credentials
from pdserve.cluster import LocalCluster
from pdserve.gateway.server import running_server
from pdserve.rpc import transport
from pdserve.rpc.auth import ClusterSecret
from pdserve.rpc.tls import (
    ClientAuth,
    TLSConfig,
    client_channel_credentials,
    client_context,
    load_tls,
)
from pdserve.runtime import start_server
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.helpers.cluster_util import cluster_fixture

pytestmark = pytest.mark.timeout(900)

TAG = uuid.uuid4().hex[:10]
SECRET = f"cluster-secret-{TAG}-{uuid.uuid4().hex}"
API_KEY = f"sk-tls-{TAG}"
REMOTE_THRESHOLD = 16
WORKERS = ("decode-0", "prefill-0")


cluster = cluster_fixture(kv_cache_mb=128, cluster_secret=SECRET, tls=True,
                          env={"PDSERVE_API_KEY": API_KEY},
                          router_args=("--placement", "threshold",
                                       "--remote-threshold", str(REMOTE_THRESHOLD)),
                          start_timeout_s=600)  # a loaded 2-core machine takes over 300 s


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    """A client certificate from another CA, valid in every other way."""
    d = tmp_path_factory.mktemp("other-ca")
    make_local_pki(d, names=("client",))
    return load_tls(d / "client.crt", d / "client.key", d / "ca.crt")


def _client_tls(cluster: LocalCluster) -> TLSConfig:
    files = cluster.tls_files()
    assert files is not None
    return load_tls(*files)


def _addr(cluster: LocalCluster, name: str) -> str:
    return f"127.0.0.1:{cluster.ports[name]}"


async def _health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    """grpc.health.v1 status of the server at `address`, over TLS with `credentials`
    (plaintext with None); raises AioRpcError when the connection is refused."""
    channel = (grpc.aio.insecure_channel(address) if credentials is None
               else grpc.aio.secure_channel(address, credentials))
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(), timeout=10)
        return int(resp.status)


async def _refused(address: str, credentials: grpc.ChannelCredentials | None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _health(address, credentials)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


# --------------------------------------------------------------------------- live cluster


async def test_tls_cluster_answers_with_the_reference_tokens(
        cluster: LocalCluster, prompt_ids: list[list[int]],
        hf_reference: list[list[int]]) -> None:
    tls = _client_tls(cluster)
    creds = tls.channel_credentials()
    routes = {}
    async with RouterClient(cluster.grpc_address, api_key=API_KEY, credentials=creds) as client:
        for i in (0, 2, len(prompt_ids) - 1):
            done = await client.complete(token_ids=prompt_ids[i],
                                         sampling=Sampling(max_tokens=32))
            assert list(done.token_ids) == hf_reference[i], i
            routes[i] = done.route
    assert routes[len(prompt_ids) - 1] == "remote"  # router -> decode and prefill, mTLS
    assert routes[0] == "local"

    async with httpx.AsyncClient(base_url=cluster.http_url, verify=tls.client_context(),
                                 timeout=300) as http:
        r = await http.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"prompt": prompt_ids[2], "max_tokens": 32,
                                  "temperature": 0})
        assert r.status_code == 200, r.text
    async with RouterClient(cluster.grpc_address, api_key=API_KEY, credentials=creds) as client:
        again = await client.complete(token_ids=prompt_ids[2], sampling=Sampling(max_tokens=32))
    assert r.json()["choices"][0]["text"] == again.text


async def test_plaintext_is_refused_on_every_hop(cluster: LocalCluster) -> None:
    await _refused(cluster.grpc_address, None)  # the router's gRPC API
    async with RouterClient(cluster.grpc_address, api_key=API_KEY) as client:
        with pytest.raises(RouterError) as refused:
            await client.complete(text="Hi", sampling=Sampling(max_tokens=2))
        assert refused.value.status == "UNAVAILABLE"
    for name in WORKERS:  # router -> worker gRPC
        await _refused(_addr(cluster, name), None)
    plain = [cluster.http_url.replace("https://", "http://") + "/health"]
    plain += [cluster.metrics_url(n).replace("https://", "http://") for n in WORKERS]
    async with httpx.AsyncClient(timeout=10) as http:
        for url in plain:
            with pytest.raises(httpx.HTTPError):
                await http.get(url)
    # The same listeners answer over TLS (the refusals above are about plaintext).
    tls = _client_tls(cluster)
    for name in WORKERS:
        assert await _health(_addr(cluster, name), tls.channel_credentials()) == \
            health_pb2.HealthCheckResponse.SERVING
    async with httpx.AsyncClient(timeout=10, verify=tls.client_context()) as http:
        assert (await http.get(f"{cluster.http_url}/health")).status_code == 200
        for name in WORKERS:
            r = await http.get(cluster.metrics_url(name))
            assert r.status_code == 200 and "pdserve" in r.text


async def test_workers_take_only_certificates_from_the_cluster_ca(
        cluster: LocalCluster, other_ca: TLSConfig) -> None:
    tls = _client_tls(cluster)
    ca = cluster.tls_dir / "ca.crt"  # type: ignore[operator]
    credential = ClusterSecret(SECRET.encode()).grpc_metadata()
    for name in WORKERS:
        address = _addr(cluster, name)
        await _refused(address, client_channel_credentials(ca))  # no client certificate
        await _refused(address, client_channel_credentials(ca, other_ca.cert, other_ca.key))
        # A client that trusts another CA does not accept the worker either.
        await _refused(address, other_ca.channel_credentials())
        # With the cluster's certificate a call gets through TLS, then needs the token.
        async with transport.channel(address, tls=tls) as ch:
            stub = (decode_pb2_grpc.DecodeWorkerStub(ch) if name.startswith("decode")
                    else prefill_pb2_grpc.PrefillWorkerStub(ch))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Stats(common_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats = await stub.Stats(common_pb2.StatsRequest(), timeout=10, metadata=credential)
            assert stats.num_total_blocks > 0
    # Worker metrics: mTLS as well (no client certificate; another CA's). In TLS 1.3 the
    # server's refusal comes as an alert on the first read: ssl.SSLError "certificate
    # required", which httpx passes on as it is.
    for verify in (client_context(ca), client_context(ca, other_ca.cert, other_ca.key)):
        async with httpx.AsyncClient(timeout=10, verify=verify) as http:
            for name in WORKERS:
                with pytest.raises((httpx.HTTPError, ssl.SSLError)):
                    await http.get(cluster.metrics_url(name))


async def test_gateway_serves_https_and_checks_its_certificate(cluster: LocalCluster) -> None:
    assert cluster.http_url.startswith("https://")
    ca = cluster.tls_dir / "ca.crt"  # type: ignore[operator]
    # The router's client-facing listeners ask no client certificate by default: the CA
    # alone (and the API key) is enough, over HTTPS and gRPC.
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=300,
                                 verify=client_context(ca)) as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 401
        r = await http.post("/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
    async with RouterClient(cluster.grpc_address, api_key=API_KEY,
                            credentials=tls_credentials(str(ca))) as client:
        done = await client.complete(text="Hi", sampling=Sampling(max_tokens=2))
        assert done.usage.completion_tokens >= 1
    async with httpx.AsyncClient(timeout=10) as http:  # the system's CAs do not know it
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await http.get(f"{cluster.http_url}/health")


# --------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_local_pki(d, names=("server", "client"))
    return d


@contextlib.asynccontextmanager
async def _grpc_server(tls: TLSConfig, mode: ClientAuth) -> AsyncIterator[str]:
    server = transport.new_server()
    health = await transport.add_health(server)
    await transport.set_serving(health)
    address = await start_server(server, "127.0.0.1", 0, tls.server_credentials(mode))
    try:
        yield address
    finally:
        await server.stop(grace=None)


async def _hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


@pytest.mark.parametrize("mode", ["none", "require"])
async def test_client_facing_listeners_ask_for_certificates_as_told(
        pki: Path, other_ca: TLSConfig, mode: ClientAuth) -> None:
    """gRPC (the router's API) and HTTPS (the gateway) with each --tls-client-auth: which
    clients get in, no certificate / one from another CA / one from the cluster's CA."""
    server_tls = load_tls(pki / "server.crt", pki / "server.key", pki / "ca.crt",
                          client_auth=mode)
    ca = pki / "ca.crt"
    mine = (pki / "client.crt", pki / "client.key")
    clients = {"no certificate": (client_channel_credentials(ca), client_context(ca)),
               "another CA's": (client_channel_credentials(ca, other_ca.cert, other_ca.key),
                                client_context(ca, other_ca.cert, other_ca.key)),
               "the CA's": (client_channel_credentials(ca, *mine), client_context(ca, *mine))}
    admitted = {"none": {"no certificate", "another CA's", "the CA's"},
                "require": {"the CA's"}}[mode]
    app = Starlette(routes=[Route("/", _hello)])
    async with _grpc_server(server_tls, mode) as address, \
            running_server(app, tls=server_tls) as gateway:
        assert gateway.url.startswith("https://")
        for who, (creds, context) in clients.items():
            if who in admitted:
                assert await _health(address, creds) == \
                    health_pb2.HealthCheckResponse.SERVING, who
            else:
                await _refused(address, creds)
            async with httpx.AsyncClient(timeout=10, verify=context) as http:
                if who in admitted:
                    assert (await http.get(gateway.url)).text == "hello", who
                else:
                    with pytest.raises(httpx.HTTPError):
                        await http.get(gateway.url)
            async with httpx.AsyncClient(timeout=10) as http:  # plaintext
                with pytest.raises(httpx.HTTPError):
                    await http.get(gateway.url.replace("https://", "http://"))


def test_certs_command_makes_private_files_for_both_uses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pki"
    assert cli_main(["certs", "--out", str(out), "--host", "10.1.2.3",
                     "--host", "node-1.internal"]) == 0
    assert "--tls-cert" in capsys.readouterr().err
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    names = {"ca", "router", "prefill", "decode", "client"}
    assert {p.name for p in out.iterdir()} == {f"{n}.{x}" for n in names for x in ("crt", "key")}
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    cert = x509.load_pem_x509_certificate((out / "decode.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(a) for a in sans.get_values_for_type(x509.IPAddress)} >= {
        "127.0.0.1", "::1", "10.1.2.3"}
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", "node-1.internal"}
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ca_before = (out / "ca.crt").read_bytes()
    assert cli_main(["certs", "--out", str(out), "--name", "decode-2"]) == 0
    assert (out / "ca.crt").read_bytes() == ca_before  # the CA is reused, not replaced
    load_tls(out / "decode-2.crt", out / "decode-2.key", out / "ca.crt")


def test_bad_tls_files_are_refused(pki: Path, other_ca: TLSConfig, tmp_path: Path) -> None:
    ca = pki / "ca.crt"
    with pytest.raises(ValueError, match="do not go together"):
        load_tls(pki / "server.crt", other_ca.key, ca)
    loose = tmp_path / "loose.key"
    loose.write_bytes((pki / "server.key").read_bytes())
    os.chmod(loose, 0o644)
    with pytest.raises(ValueError, match="chmod 600") as refused:
        load_tls(pki / "server.crt", loose, ca)
    assert "PRIVATE KEY" not in str(refused.value)
    with pytest.raises(ValueError, match="no PEM certificate"):
        load_tls(pki / "server.crt", pki / "server.key", pki / "server.key")
    # A worker given part of the TLS flags, or a loose key, stops before loading anything.
    for argv, why in ((["--tls-cert", str(pki / "server.crt")], "together"),
                      (["--tls-cert", str(pki / "server.crt"), "--tls-key", str(loose),
                        "--tls-ca", str(ca)], "chmod 600")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_TLS")}
        done = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode-worker",
                               "--redis-url", "redis://127.0.0.1:1/0", *argv],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 1 and why in done.stderr, done.stderr
