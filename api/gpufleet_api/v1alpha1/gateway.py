"""spec.gateway: the service behind a Gateway API gateway through the Inference Extension (an InferencePool
whose Endpoint Picker is the router, and optionally the HTTPRoute that attaches it to a Gateway)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Model

from .common import DNS_LABEL, DNS_SUBDOMAIN

DataPath = Literal["Direct", "Router"]
DIRECT: DataPath = "Direct"
ROUTER: DataPath = "Router"
DIRECT_DISAGGREGATION_MESSAGE = (
    "spec.gateway.dataPath Direct cannot serve spec.disaggregation: the gateway sends each request to one "
    "pod, and only the router hands a prompt from a prefill pod to a decode pod; set spec.gateway.dataPath "
    "to Router (or leave it unset)")


class ParentGatewayRef(Model, frozen=True, kw_only=True):
    """The Gateway the operator attaches the service's HTTPRoute to."""
    name: Annotated[str, Meta(description="The Gateway's name.", pattern=DNS_SUBDOMAIN, min_length=1,
                              max_length=253)]
    namespace: Optional[Annotated[str, Meta(
        description="The Gateway's namespace; unset: the InferenceService's. Its listener must allow routes "
                    "from this namespace (allowedRoutes).",
        pattern=DNS_LABEL, max_length=63)]] = None
    section_name: Optional[Annotated[str, Meta(
        description="One listener of the Gateway (its name); unset: every listener that allows the route.",
        pattern=DNS_SUBDOMAIN, min_length=1, max_length=253)]] = None


class GatewaySpec(Model, frozen=True, kw_only=True):
    """The service behind a gateway of the Gateway API Inference Extension (docs/gateway-api.md): the operator
    renders an InferencePool named as the service, whose Endpoint Picker is the router's (the chart's
    router.epp), and with parentRef an HTTPRoute from that Gateway to the pool."""
    data_path: Optional[Annotated[DataPath, Meta(
        description="Direct: the pool's endpoints are the engine pods' guard port; the picker chooses one and "
                    "the gateway sends the request straight to it (no prefill/decode hand-off, no mid-stream "
                    "resumption, no router-side tenant limits). Router: the pool's endpoints are the routers' "
                    "pods, which pick and relay as they do for their own clients (one hop more). Unset: Router "
                    "with spec.disaggregation, else Direct.")]] = None
    failure_mode: Annotated[Literal["FailOpen", "FailClose"], Meta(
        description="What the gateway does while the picker does not answer (the InferencePool's "
                    "endpointPickerRef.failureMode): FailClose refuses the request, FailOpen sends it to a pod of "
                    "the pool the gateway chooses itself.")] = "FailClose"
    parent_ref: Optional[Annotated[ParentGatewayRef, Meta(
        description="The Gateway to attach to: the operator renders an HTTPRoute <service> from it to the "
                    "pool for the path /v1. Unset: no HTTPRoute (write your own, with the InferencePool "
                    "<service> as its backendRef).")]] = None
    model_match: Annotated[Literal["None", "Header"], Meta(
        description="With parentRef: None matches the path /v1 only; Header also matches the "
                    "X-Gateway-Model-Name header to the served name (set from the body by GIE's body-based "
                    "router), so several services can share one Gateway's /v1.")] = "None"


# --- status ------------------------------------------------------------------------


class GatewayParentCondition(Model, frozen=True, kw_only=True):
    """One condition a gateway wrote on the InferencePool (Accepted, ResolvedRefs), as it wrote it."""
    type: Annotated[str, Meta(description="Accepted or ResolvedRefs (or another the gateway writes).")]
    status: Annotated[str, Meta(description="True, False or Unknown.")]
    reason: Annotated[str, Meta(description="The gateway's reason.")] = ""
    message: Annotated[str, Meta(description="The gateway's message.")] = ""


class GatewayParentStatus(Model, frozen=True, kw_only=True):
    """One parent (a Gateway) of the InferencePool, copied from the pool's status.parents."""
    kind: Annotated[str, Meta(description="The parent's kind (Gateway).")] = "Gateway"
    name: Annotated[str, Meta(description="The parent's name.")]
    namespace: Optional[Annotated[str, Meta(description="The parent's namespace (unset: the pool's).")]] = None
    controller_name: Optional[Annotated[str, Meta(description="The gateway controller that wrote it.")]] = None
    conditions: Annotated[list[GatewayParentCondition], Meta(
        description="Its Accepted and ResolvedRefs conditions.")] = msgspec.field(default_factory=list)


class GatewayStatus(Model, frozen=True, kw_only=True):
    """What the operator rendered for spec.gateway and what the gateways made of it."""
    inference_pool: Annotated[str, Meta(description="The InferencePool (inference.networking.k8s.io/v1).")]
    http_route: Optional[Annotated[str, Meta(
        description="The HTTPRoute (gateway.networking.k8s.io/v1), with spec.gateway.parentRef.")]] = None
    data_path: Annotated[str, Meta(description="Direct or Router: what the pool's endpoints are.")]
    accepted_by: Optional[Annotated[str, Meta(
        description="The gateways that accepted the pool with its references resolved (namespace/name, "
                    "comma-separated); absent while none has.")]] = None
    parents: Annotated[list[GatewayParentStatus], Meta(
        description="The pool's status.parents as the gateways wrote them (at most 32).")] = \
        msgspec.field(default_factory=list)
