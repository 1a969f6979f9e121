"""Throwaway certificates for TLS tests: a CA, a server certificate (for 127.0.0.1/localhost,
or the names given: a testbed host's address), and a client certificate. Generated per test
session, never stored in the repo."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certificates:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def make_certificates(
    directory: Path, server_names: tuple[str, ...] = ("localhost", "127.0.0.1")
) -> Certificates:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("skyrl test CA"))
        .issuer_name(_name("skyrl test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(
        name: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]
    ) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path = directory / f"{name}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(cert_path), _write_key(key, directory / f"{name}-key.pem")

    server_cert, server_key = leaf("server", ExtendedKeyUsageOID.SERVER_AUTH, _sans(server_names))
    client_cert, client_key = leaf(
        "client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("trainer")]
    )
    return Certificates(str(directory / "ca.pem"), server_cert, server_key, client_cert, client_key)


def _sans(names: tuple[str, ...]) -> list[x509.GeneralName]:
    """Subject alternative names: an IP address as one, anything else as a DNS name."""
    found: list[x509.GeneralName] = []
    for name in names:
        try:
            found.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            found.append(x509.DNSName(name))
    return found
