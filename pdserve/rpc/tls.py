"""TLS on every hop: one certificate, key and CA per process, read and checked once.

A process given ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (`pdserve certs` makes a local
CA and certificates for them) serves and dials TLS only; nothing of it listens in plaintext.

- **Workers** (prefill, decode) require a client certificate signed by the CA on their gRPC
  and metrics listeners (mTLS): only the cluster's own processes reach them, whatever the
  network, and the cluster token travels encrypted.
- **The router** dials the workers with its certificate (it is their client) and checks
  theirs against the CA; its client-facing listeners (the gRPC API and the HTTP gateway)
  ask for a client certificate as ``--tls-client-auth`` says: ``none`` (API keys only; the
  default) or ``require`` (one signed by the CA, besides the API key). There is no
  "optional": grpc's Python API can request a client certificate only without verifying
  it, and a certificate that is merely allowed would admit nobody who is not admitted
  without one.
- **Clients** (`pdserve.client.RouterClient`, `pdserve health`, the cluster's own readiness
  check) verify the server's certificate against the CA, and present theirs when given.

Certificates are checked against the address dialled (``127.0.0.1``, a host name), so a
worker's certificate names the address it advertises; where addresses are not known in
advance (pods), give every worker's certificate one name and the router ``--tls-server-name``.

The key file must be private (mode 600, owned by this user or root: the cluster secret's
rule, `pdserve.private_file`); the key never goes on a command line or into a log, only its
path does.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import grpc

from pdserve.private_file import read_private_text

ClientAuth = Literal["none", "require"]
CLIENT_AUTH_CHOICES: tuple[str, ...] = get_args(ClientAuth)
TLS_CERT_ENV = "PDSERVE_TLS_CERT"
TLS_KEY_ENV = "PDSERVE_TLS_KEY"
TLS_CA_ENV = "PDSERVE_TLS_CA"
_CERT_REQS = {"none": ssl.CERT_NONE, "require": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TLSConfig:
    """A process's certificate chain, private key and trusted CA, as PEM bytes read once
    (`load_tls`), with their paths for the servers that load files themselves (uvicorn,
    the metrics endpoint). `client_auth` applies to client-facing listeners only; workers
    always require a client certificate. `server_name`: the name peers' certificates must
    carry, instead of the address dialled (None: the address)."""

    cert: Path
    key: Path
    ca: Path
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    ca_pem: bytes = field(repr=False)
    client_auth: ClientAuth = "none"
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.client_auth not in CLIENT_AUTH_CHOICES:
            raise ValueError(f"client_auth must be one of {', '.join(CLIENT_AUTH_CHOICES)}, "
                             f"got {self.client_auth!r}")

    def server_credentials(self, client_auth: ClientAuth = "require") -> grpc.ServerCredentials:
        """gRPC server credentials; with ``require`` (the workers' setting) a client
        certificate signed by the CA is required, with ``none`` none is asked for."""
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=None if client_auth == "none" else self.ca_pem,
            require_client_auth=client_auth == "require")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: trust the CA only, present this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem,
                                            private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        """Extra channel options: the peer name to verify, when one is set."""
        return [] if self.server_name is None else [
            ("grpc.ssl_target_name_override", self.server_name)]

    def uvicorn_options(self, client_auth: ClientAuth | None = None) -> dict[str, object]:
        """`uvicorn.Config` keyword arguments serving HTTPS with this certificate."""
        return dict(ssl_certfile=str(self.cert), ssl_keyfile=str(self.key),
                    ssl_ca_certs=str(self.ca),
                    ssl_cert_reqs=_CERT_REQS[client_auth or self.client_auth])

    def server_context(self, client_auth: ClientAuth | None = None) -> ssl.SSLContext:
        """An `ssl.SSLContext` for an HTTPS server with this certificate; client
        certificates checked against the CA as `client_auth` (default: this config's) says."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        ctx.verify_mode = _CERT_REQS[client_auth or self.client_auth]
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """An `ssl.SSLContext` for HTTPS clients (httpx ``verify=``): trusts the CA only,
        checks the host name, presents this certificate."""
        return client_context(self.ca, self.cert, self.key)


def client_context(ca: str | Path, cert: str | Path | None = None,
                   key: str | Path | None = None) -> ssl.SSLContext:
    """An HTTPS client context that trusts `ca` only and checks host names, presenting
    `cert` (with its private `key`) when given; ValueError naming a bad file."""
    ca_pem = _read_pem(Path(ca), "the TLS CA file")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    if cert is not None and key is not None:
        read_private_text(key, "the TLS key file")  # the same rule as a server's key
        try:
            ctx.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cannot use the TLS certificate {cert} with key {key}: "
                             f"{exc}") from None
    return ctx


def client_channel_credentials(ca: str | Path, cert: str | Path | None = None,
                               key: str | Path | None = None) -> grpc.ChannelCredentials:
    """gRPC channel credentials that trust `ca` only, presenting `cert` when given."""
    ca_pem = _read_pem(Path(ca), "the TLS CA file")
    if cert is None or key is None:
        return grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, certificate_chain=_read_pem(Path(cert), "the TLS certificate"),
        private_key=read_private_text(key, "the TLS key file").encode())


def load_tls(cert: str | Path, key: str | Path, ca: str | Path, *,
             client_auth: ClientAuth = "none", server_name: str | None = None) -> TLSConfig:
    """Read and check the three files; ValueError naming the file and the problem (never
    quoting the key) when one cannot be read, is not PEM of the right kind, the key is not
    private (`pdserve.private_file`) or does not belong to the certificate."""
    cert, key, ca = Path(cert), Path(key), Path(ca)
    key_pem = read_private_text(key, "the TLS key file").encode()
    cert_pem, ca_pem = _read_pem(cert, "the TLS certificate"), _read_pem(ca, "the TLS CA file")
    if b"PRIVATE KEY-----" not in key_pem:
        raise ValueError(f"the TLS key file {key} holds no PEM private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_verify_locations(cadata=ca_pem.decode())
    except ssl.SSLError as exc:
        raise ValueError(f"the TLS CA file {ca} is not a PEM certificate: {exc.reason}") from None
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"the TLS certificate {cert} and key {key} do not go together "
                         f"({exc.reason})") from None
    return TLSConfig(cert=cert, key=key, ca=ca, cert_pem=cert_pem, key_pem=key_pem,
                     ca_pem=ca_pem, client_auth=client_auth, server_name=server_name)


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(f"{what} {path} holds no PEM certificate")
    return data
