import pytest

from gpufleet_kit.kube.request_kind import request_kind


@pytest.mark.parametrize("method, path, params, expected", [
    ("GET", "/api/v1/namespaces/ns/pods", {"labelSelector": "a=b"}, ("list", "pods")),
    ("GET", "/api/v1/namespaces/ns/pods/p-1", None, ("get", "pods")),
    ("GET", "/api/v1/nodes/n1", None, ("get", "nodes")),
    ("GET", "/api/v1/nodes", None, ("list", "nodes")),
    ("GET", "/apis/apps/v1/namespaces/ns/deployments", {"watch": "true"}, ("watch", "deployments")),
    ("PATCH", "/apis/serving.gpufleet.dev/v1alpha1/namespaces/ns/inferenceservices/s/status", None,
     ("patch", "inferenceservices/status")),
    ("POST", "/api/v1/namespaces/ns/events", None, ("create", "events")),
    ("DELETE", "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/s-engine", None,
     ("delete", "poddisruptionbudgets")),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", None, ("update", "leases")),
    ("GET", "/apis/apps/v1", None, ("get", "")),
    ("GET", "/version", None, ("get", "")),
])
def test_requests_are_named_as_the_api_server_counts_them(method, path, params, expected):
    assert request_kind(method, path, params) == expected
