"""The endpoint picker's TLS: gateways speak TLS to it (GIE's envoy.yaml, and the gateway controllers, expect
it and skip verifying the picker's certificate), so it serves TLS unless told not to. With a certificate folder
(GIE's --cert-path: tls.crt and tls.key, a Secret mounted there) it serves that one; without, one it makes at
start, self-signed, as GIE's picker does."""
from __future__ import annotations

import datetime
import pathlib
import socket

import grpc

from ..errors import RouterError

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"
SELF_SIGNED_DAYS = 3650


def self_signed(host: str | None = None) -> tuple[bytes, bytes]:
    """(key, certificate) in PEM: an ECDSA P-256 key and a certificate for ``host`` (the machine's name)."""
    # Imported here: only a picker serving TLS without a certificate of its own needs it, never the operator
    # process that shares this package's image and CLI (tests/unit/test_packaging.py).
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    name = host or socket.gethostname() or "gpufleet-router"
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufleet"),
                         x509.NameAttribute(NameOID.COMMON_NAME, name[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name[:253]), x509.DNSName("localhost")]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


class CertificateError(RouterError, ValueError):
    """The certificate folder lacks a file or holds one that is not PEM."""


def from_folder(folder: str) -> tuple[bytes, bytes]:
    """(key, certificate) read from ``folder``'s tls.key and tls.crt."""
    path = pathlib.Path(folder)
    try:
        key, cert = (path / KEY_FILE).read_bytes(), (path / CERT_FILE).read_bytes()
    except OSError as e:
        raise CertificateError(f"--epp-cert-path {folder}: cannot read {e.filename} ({e.strerror}); the folder "
                               f"must hold {CERT_FILE} and {KEY_FILE} (a kubernetes.io/tls Secret mounted there)") \
            from None
    for label, pem in ((KEY_FILE, key), (CERT_FILE, cert)):
        if b"-----BEGIN" not in pem:
            raise CertificateError(f"--epp-cert-path {folder}: {label} is not PEM")
    return key, cert


def credentials(cert_path: str | None) -> grpc.ServerCredentials:
    key, cert = from_folder(cert_path) if cert_path else self_signed()
    return grpc.ssl_server_credentials([(key, cert)])
