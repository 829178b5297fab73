"""A throwaway certificate authority for the TLS tests (``cryptography``; nothing on disk
outside the directory it is given).

:func:`make_ca` makes a CA; :meth:`TestCa.issue` a certificate it signs for 127.0.0.1 and
localhost that serves and authenticates clients alike (the tests' replicas,
orchestrator and clients all use such certificates, as ``docs/security.md`` sets up
with openssl).
"""

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
class Issued:
    """A certificate and its key as PEM files."""

    cert: str
    key: str


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return str(path)


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


class TestCa:
    """A CA whose certificate is ``ca_file``; it issues leaf certificates into ``directory``."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test CA")])
        builder = (
            _validity(x509.CertificateBuilder())
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )
        self.cert = builder.sign(self.key, hashes.SHA256())
        self.ca_file = str(directory / f"{name}-ca.pem")
        Path(self.ca_file).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Issued:
        """A certificate for ``hosts`` (IP addresses or DNS names), for servers and clients."""
        key = ec.generate_private_key(ec.SECP256R1())
        alt_names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt_names.append(x509.DNSName(host))
        cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        stem = self.directory / f"{self.name}-{name}"
        cert_path = stem.with_suffix(".crt")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Issued(str(cert_path), _write_key(key, stem.with_suffix(".key")))


def make_ca(directory: Path, name: str = "specserve") -> TestCa:
    return TestCa(directory, name)
