"""A local certificate authority for TLS between pdserve's processes (`pdserve certs`).

`make_local_pki(out, names, hosts)` writes into `out` (created mode 700):

- ``ca.crt`` / ``ca.key``: a CA (P-256, 10 years by default), made once and reused, so more
  certificates can be issued later from the same CA;
- ``NAME.crt`` / ``NAME.key`` per name: a certificate signed by that CA for both uses a
  pdserve process has (serverAuth: it listens; clientAuth: it dials other processes), valid
  for ``localhost``, ``127.0.0.1``, ``::1`` and every host given (names and addresses).

Every file is mode 600 (written through a new file descriptor, never world-readable even
for a moment). Keys are ECDSA P-256: a fast handshake and small records.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("router", "prefill", "decode", "client")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class IssuedCert:
    name: str
    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to a file created (or truncated) with mode 600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode otherwise
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # order kept, repeats dropped
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # small clock skew
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key),
                           critical=False))


def _load_or_make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = out / "ca.crt", out / "ca.key"
    if cert_path.exists() and key_path.exists():
        from pdserve.private_file import read_private_text

        key = serialization.load_pem_private_key(
            read_private_text(key_path, "the CA key file").encode(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"the CA key {key_path} is not an EC key")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve local CA")])
    cert = (_builder("pdserve local CA", name, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, _key_pem(key))
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def make_local_pki(out: str | Path, names: Sequence[str] = DEFAULT_NAMES,
                   hosts: Sequence[str] = (), *, days: int = 365,
                   ca_days: int = 3650) -> list[IssuedCert]:
    """Make (or reuse) the CA in `out` and issue a certificate per name, valid for the
    loopback names and `hosts`; returns what was written. ValueError for a bad name."""
    out = Path(out)
    for name in names:
        if not name or "/" in name or name.startswith(".") or name == "ca":
            raise ValueError(f"bad certificate name {name!r}")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_cert, ca_key = _load_or_make_ca(out, ca_days)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    issued = []
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(f"pdserve {name}", ca_cert.subject, key.public_key(), days)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                             content_commitment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=False,
                                             crl_sign=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(
                    x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                    critical=False)
                .add_extension(_san([*LOOPBACK_HOSTS, *hosts]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        cert_path, key_path = out / f"{name}.crt", out / f"{name}.key"
        _write_private(key_path, _key_pem(key))
        _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        issued.append(IssuedCert(name, cert_path, key_path))
    return issued
