"""Certificates and keys for the local control plane.

One CA signs the apiserver's serving certificate and a client certificate per
identity (admin in system:masters, the controller manager and the scheduler
under their well-known user names, so the default RBAC bindings apply). A
separate RSA key pair signs service-account tokens.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

CLIENTS = {
    "admin": ("admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kwok": ("kwok-controller", "system:masters"),
}


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(cert, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _sign(subject, pub, ca_key, ca_name, *, ca=False, server_names=(), client=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(pub)
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=3650))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    else:
        usages = [x509.ExtendedKeyUsageOID.CLIENT_AUTH] if client else [x509.ExtendedKeyUsageOID.SERVER_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names:
        sans = []
        for n in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def _apiserver_names(service_ip: str, node_ip: str) -> tuple[str, ...]:
    return ("127.0.0.1", "localhost", node_ip, service_ip, "kubernetes", "kubernetes.default",
            "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")


def _load_ca(d: Path):
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    return ca_key, x509.load_pem_x509_certificate((d / "ca.crt").read_bytes()).subject


def _write_apiserver_cert(d: Path, ca_key, ca_name, names: tuple[str, ...]) -> None:
    key = _key()
    _write_key(key, d / "apiserver.key")
    _write_cert(_sign(_name("kube-apiserver"), key.public_key(), ca_key, ca_name, server_names=names),
                d / "apiserver.crt")


def _apiserver_cert_covers(d: Path, node_ip: str) -> bool:
    cert = x509.load_pem_x509_certificate((d / "apiserver.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ipaddress.ip_address(node_ip) in sans.get_values_for_type(x509.IPAddress)


def ensure_pki(d: Path, service_ip: str = "10.96.0.1", node_ip: str = "10.213.0.1") -> None:
    """Create everything missing under ``d`` (idempotent: a restart keeps identities).

    The apiserver's certificate also names ``node_ip``, the address it binds with a real node
    (``gpufleet dev up --real-node``); an older one without it is re-signed by the same CA.
    """
    d.mkdir(parents=True, exist_ok=True)
    if (d / "ca.crt").exists() and all((d / f"{c}.crt").exists() for c in CLIENTS):
        if not _apiserver_cert_covers(d, node_ip):
            _write_apiserver_cert(d, *_load_ca(d), _apiserver_names(service_ip, node_ip))
        return
    ca_key = _key()
    ca_name = _name("gpufleet-local-ca")
    _write_key(ca_key, d / "ca.key")
    _write_cert(_sign(ca_name, ca_key.public_key(), ca_key, ca_name, ca=True), d / "ca.crt")
    _write_apiserver_cert(d, ca_key, ca_name, _apiserver_names(service_ip, node_ip))
    for file, (cn, org) in CLIENTS.items():
        key = _key()
        _write_key(key, d / f"{file}.key")
        _write_cert(_sign(_name(cn, org), key.public_key(), ca_key, ca_name, client=True), d / f"{file}.crt")
    sa = _key()
    _write_key(sa, d / "sa.key")
    (d / "sa.pub").write_bytes(sa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
