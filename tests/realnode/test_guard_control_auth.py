"""The guard's control routes on real pods (docs/security.md, "The guard's control routes"): a caller
inside the engine pod from 127.0.0.6 (where Istio's inbound sidecar connects from) and a pod beside the
service with its own ServiceAccount token are refused; the operator's pod, with the token the chart
projects for it, is answered. Connections are made from inside the pods (kubectl exec, python3)."""
from __future__ import annotations

import json

import pytest

from gpufleet.manifests import names
from tests.realnode.product import SERVICE, _pods
from tests.realnode.test_network_policy import _one_ready, probes  # noqa: F401  (the probe pods fixture)

pytestmark = pytest.mark.timeout(600)

# Prints "<status> <body>": one request from a chosen source address, with an optional bearer token
# read from a file (the pod's own token, or the operator's projected one).
REQUEST = """
import http.client, sys
source, host, port, method, path, token_file = sys.argv[1:7]
headers = {"Content-Type": "application/json"}
if token_file != "-":
    headers["Authorization"] = "Bearer " + open(token_file).read().strip()
c = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0) if source != "-" else None)
c.request(method, path, body=sys.argv[7] if len(sys.argv) > 7 else None, headers=headers)
r = c.getresponse()
print(r.status, r.read().decode())
"""
ADAPTERS = json.dumps({"adapters": [{"name": "tenant-a", "source": {"uri": "https://attacker.example/w.tar"}}]})
POD_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
OPERATOR_TOKEN = "/var/run/secrets/gpufleet/guard/token"


def request(control_plane, ns: str, pod: str, container: str | None, source: str, host: str, method: str,
            path: str, token_file: str = "-", body: str | None = None) -> tuple[int, str]:
    where = ["-c", container] if container else []
    out = control_plane.kubectl("-n", ns, "exec", pod, *where, "--", "python3", "-c", REQUEST, source, host,
                                str(names.GUARD_PORT), method, path, token_file, *([body] if body else [])
                                ).stdout.strip()
    status, _, text = out.partition(" ")
    return int(status), text


async def engine_pod(kube, ns: str) -> dict:
    return (await _pods(kube, ns, names.selector_string(SERVICE)))[0]


async def test_a_caller_on_the_pods_loopback_from_a_sidecars_address_is_refused(service, install, control_plane,
                                                                               kube):
    pod = (await engine_pod(kube, install.work_ns))["metadata"]["name"]
    ns = install.work_ns
    for source in ("127.0.0.6", "127.0.0.1"):
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "PUT", "/adapters",
                               body=ADAPTERS)
        assert status == 401 and "accepts the gpufleet operator only" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "GET", "/audit")
        assert status == 401 and "no Authorization header" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "POST", "/drain")
        assert status == 403 and "admin socket" in text, text
        status, text = request(control_plane, ns, pod, "guard", source, "127.0.0.1", "POST", "/reset_prefix_cache")
        assert status == 401, text
    status, text = request(control_plane, ns, pod, "guard", "-", "127.0.0.1", "GET", "/drain")
    assert status == 200 and json.loads(text)["draining"] is False


async def test_a_pod_beside_the_service_with_its_own_token_is_refused(service, install, probes,  # noqa: F811
                                                                       control_plane, kube):
    engine = (await engine_pod(kube, install.work_ns))["status"]["podIP"]
    # The probe's automounted token is for the API server's audience, not the guard's.
    status, text = request(control_plane, install.work_ns, "probe", None, "-", engine, "GET", "/audit", POD_TOKEN)
    assert status == 401 and "audience" in text, text
    status, text = request(control_plane, install.work_ns, "probe", None, "-", engine, "POST", "/drain", POD_TOKEN)
    assert status == 403, text


async def test_the_operators_pod_is_answered_with_its_projected_token(service, install, control_plane, kube):
    engine = (await engine_pod(kube, install.work_ns))["status"]["podIP"]
    operator = (await _one_ready(kube, install.operator_ns, "app.kubernetes.io/name=gpufleet-operator"))[
        "metadata"]["name"]
    status, text = request(control_plane, install.operator_ns, operator, None, "-", engine, "GET", "/audit",
                           OPERATOR_TOKEN)
    assert status == 200 and json.loads(text)["kv"], text
    status, text = request(control_plane, install.operator_ns, operator, None, "-", engine, "GET", "/audit")
    assert status == 401, text
    logs = control_plane.kubectl("-n", install.operator_ns, "logs", operator, check=False).stdout
    assert "answered 401" not in logs and "refuse the operator" not in logs, logs[-3000:]
