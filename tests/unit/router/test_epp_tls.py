"""The endpoint picker's TLS: a self-signed certificate made at start, or the one a folder holds (GIE's
--cert-path), served to a gRPC client that checks it; a folder without the files is refused with its fix."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpufleet_router.epp import protocol, tls
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.server import Fleet, RouterSettings
from tests.support import epp as envoy


async def _health_over_tls(fleet: Fleet, cert: bytes) -> int:
    async with envoy.epp(fleet) as (_, address):
        credentials = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(address, credentials,
                                           options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            got = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=protocol.SERVICE_NAME))
            return got.status


async def test_a_certificate_folder_is_served(tmp_path):
    key, cert = tls.self_signed("localhost")
    (tmp_path / tls.KEY_FILE).write_bytes(key)
    (tmp_path / tls.CERT_FILE).write_bytes(cert)
    fleet = Fleet(RouterSettings(epp_cert_path=str(tmp_path)), RouterMetrics())
    assert await _health_over_tls(fleet, cert) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_by_default_it_serves_tls_with_a_certificate_of_its_own(monkeypatch):
    made: list[bytes] = []
    original = tls.self_signed

    def recorded(host: str | None = None) -> tuple[bytes, bytes]:
        key, cert = original("localhost")
        made.append(cert)
        return key, cert
    monkeypatch.setattr(tls, "self_signed", recorded)
    fleet = Fleet(RouterSettings(), RouterMetrics())
    assert fleet.settings.epp_secure
    async with envoy.epp(fleet) as (_, address):
        assert made
        # A plaintext client gets nowhere.
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        credentials = grpc.ssl_channel_credentials(root_certificates=made[0])
        async with grpc.aio.secure_channel(address, credentials,
                                           options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_folder_without_the_files_is_refused_with_its_fix(tmp_path):
    with pytest.raises(tls.CertificateError, match="tls.key"):
        tls.from_folder(str(tmp_path))
    (tmp_path / tls.KEY_FILE).write_text("not pem")
    (tmp_path / tls.CERT_FILE).write_text("not pem")
    with pytest.raises(tls.CertificateError, match="not PEM"):
        tls.from_folder(str(tmp_path))
