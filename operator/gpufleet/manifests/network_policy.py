"""The NetworkPolicy of an InferenceService's engine pods. Pure.

vLLM listens on the pod's loopback, so the guard's port is the only way into
an engine pod; this policy says who may use it: the operator's pods (it reads
each replica's metrics and audit report), Prometheus, the router or gateway
namespaces, and — unless turned off — pods in the service's own namespace.
A service whose KV connector moves KV between its pods over the network (Nixl, LMCache:
``kv_transfer.moves_kv_over_network``) also lets its engine pods reach each other on any port
(NIXL's side channel and its transports pick ports of their own).
Egress is left open: vLLM downloads weights from wherever the spec says.
docs/security.md says what the policy does and does not cover.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from . import names

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class EngineIngress:
    """Who may reach engine pods on the guard's port (the operator's --network-policy-* options)."""
    operator_namespace: str
    operator_pod_labels: Mapping[str, str]
    client_namespaces: tuple[str, ...] = ()       # a router, a gateway
    prometheus_namespaces: tuple[str, ...] = ()
    same_namespace: bool = True                   # clients beside the service, in its namespace

    def __post_init__(self) -> None:
        if not self.operator_namespace:
            raise ValueError("the operator's namespace is needed to let it reach the engines: "
                             "pass --network-policy-operator-namespace")
        if not self.operator_pod_labels:
            raise ValueError("the operator pods' labels are needed to let them reach the engines: "
                             "pass --network-policy-operator-label KEY=VALUE")


def namespaces_selector(namespaces: tuple[str, ...] | list[str]) -> dict:
    return {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In",
                                  "values": sorted(set(namespaces))}]}


def build_network_policy(isvc: dict, ingress: EngineIngress, *, kv_peers: bool = False) -> dict:
    """``kv_peers``: the service's engine pods exchange KV with each other."""
    service, namespace = isvc["metadata"]["name"], isvc["metadata"]["namespace"]
    peers: list[dict] = [{
        "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ingress.operator_namespace}},
        "podSelector": {"matchLabels": dict(ingress.operator_pod_labels)},
    }]
    others = (*ingress.client_namespaces, *ingress.prometheus_namespaces)
    if others:
        peers.append({"namespaceSelector": namespaces_selector(others)})
    if ingress.same_namespace:
        peers.append({"podSelector": {}})  # without a namespaceSelector: the policy's own namespace
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": names.networkpolicy_name(service), "namespace": namespace,
                     "labels": names.common_labels(service), "ownerReferences": [names.owner_reference(isvc)]},
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(service)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": names.GUARD_PORT}]},
                        *([{"from": [{"podSelector": {"matchLabels": names.selector_labels(service)}}]}]
                          if kv_peers else [])],
        },
    }
