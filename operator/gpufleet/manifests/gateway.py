"""Pure builders for spec.gateway: the InferencePool (inference.networking.k8s.io/v1) whose Endpoint Picker is
the router's, and the HTTPRoute from the named Gateway to it (docs/gateway-api.md).

The pool's ``endpointPickerRef`` can only name a Service in the pool's own namespace (GIE v1 has no namespace
there, and gateways must not follow ExternalName Services), and its selector only pods there: the router's EPP
Service (``gateway_api.EPP_SERVICE``, the chart's router.epp) is read from the service's namespace, and a pool of
data path Router selects the pods that Service selects, on the port its ``http`` port targets."""
from __future__ import annotations

import dataclasses

from gpufleet_api import gateway_api as gie
from gpufleet_api.route import gateway_via_router, served_name
from gpufleet_api.v1alpha1 import DIRECT, ROUTER, InferenceServiceSpec

from . import names

PATH_PREFIX = "/v1"


@dataclasses.dataclass(frozen=True)
class EndpointPicker:
    """The router's EPP Service in a namespace, as a pool needs it."""
    service: str
    port: int                       # the Service's grpc-epp port (endpointPickerRef.port is the Service's port)
    router_selector: dict[str, str]  # the routers' pods: a Router pool's selector
    router_port: int | None          # the routers' OpenAI port (the http port's targetPort): a Router pool's port


def endpoint_picker(svc: dict) -> EndpointPicker | str:
    """The EndpointPicker the router's EPP Service describes, or what is wrong with it (for the condition)."""
    name = svc["metadata"]["name"]
    spec = svc.get("spec") or {}
    ports = {p.get("name"): p for p in spec.get("ports") or []}
    epp = ports.get(gie.EPP_PORT_NAME)
    if epp is None or not isinstance(epp.get("port"), int):
        return f"Service {name} has no port named {gie.EPP_PORT_NAME}"
    http = ports.get(gie.EPP_SERVICE_HTTP_PORT_NAME) or {}
    target = http.get("targetPort")
    selector = spec.get("selector") or {}
    return EndpointPicker(name, epp["port"], dict(selector), target if isinstance(target, int) else None)


def data_path(spec: InferenceServiceSpec) -> str:
    return ROUTER if gateway_via_router(spec) else DIRECT


def router_problem(spec: InferenceServiceSpec, picker: EndpointPicker) -> str | None:
    """Why a pool of data path Router cannot be rendered from ``picker`` (None: it can, or it is Direct)."""
    if not gateway_via_router(spec):
        return None
    if not picker.router_selector:
        return f"Service {picker.service} selects no pods, so the pool of data path Router would have no router"
    if picker.router_port is None:
        return (f"Service {picker.service} has no port {gie.EPP_SERVICE_HTTP_PORT_NAME!r} with a numeric "
                f"targetPort (the routers' OpenAI port), which a pool of data path Router targets")
    return None


def _meta(isvc: dict, name: str) -> dict:
    service = isvc["metadata"]["name"]
    return {"name": name, "namespace": isvc["metadata"]["namespace"], "labels": names.common_labels(service),
            "ownerReferences": [names.owner_reference(isvc)]}


def build_inference_pool(isvc: dict, spec: InferenceServiceSpec, picker: EndpointPicker) -> dict:
    """The service's InferencePool: Direct, its engine pods (every pool's, a canary's too: the picker weighs
    revisions) on the guard's port; Router, the routers' pods on their OpenAI port. The Endpoint Picker is the
    router's, with spec.gateway.failureMode. ``router_problem`` must be None."""
    assert spec.gateway is not None
    service = isvc["metadata"]["name"]
    if gateway_via_router(spec):
        assert picker.router_port is not None
        selector, port = dict(picker.router_selector), picker.router_port
    else:
        selector, port = names.selector_labels(service), names.GUARD_PORT
    return {
        "apiVersion": gie.INFERENCE_POOL_API_VERSION, "kind": gie.INFERENCE_POOL_KIND,
        "metadata": _meta(isvc, names.inference_pool_name(service)),
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker.service,
                                  "port": {"number": picker.port}, "failureMode": spec.gateway.failure_mode},
        },
    }


def build_http_route(isvc: dict, spec: InferenceServiceSpec) -> dict | None:
    """The HTTPRoute from spec.gateway.parentRef's Gateway to the pool, for the path /v1 (and, with modelMatch
    Header, the served name in X-Gateway-Model-Name); None without a parentRef. Its request timeout is the
    guard's (admission.requestTimeoutSeconds): a gateway's default (Envoy's 15 s) would cut long answers."""
    gateway = spec.gateway
    if gateway is None or gateway.parent_ref is None:
        return None
    service = isvc["metadata"]["name"]
    ref = gateway.parent_ref
    parent = {"group": gie.GATEWAY_GROUP, "kind": gie.GATEWAY_KIND, "name": ref.name}
    if ref.namespace:
        parent["namespace"] = ref.namespace
    if ref.section_name:
        parent["sectionName"] = ref.section_name
    match: dict = {"path": {"type": "PathPrefix", "value": PATH_PREFIX}}
    if gateway.model_match == "Header":
        match["headers"] = [{"type": "Exact", "name": gie.MODEL_NAME_HEADER, "value": served_name(spec)}]
    return {
        "apiVersion": gie.HTTPROUTE_API_VERSION, "kind": gie.HTTPROUTE_KIND,
        "metadata": _meta(isvc, names.http_route_name(service)),
        "spec": {
            "parentRefs": [parent],
            "rules": [{
                "matches": [match],
                "backendRefs": [{"group": gie.INFERENCE_POOL_GROUP, "kind": gie.INFERENCE_POOL_KIND,
                                 "name": names.inference_pool_name(service)}],
                "timeouts": {"request": f"{spec.admission.request_timeout_seconds}s"},
            }],
        },
    }
