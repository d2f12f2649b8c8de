"""The Gateway API Inference Extension's names (GIE, kubernetes-sigs/gateway-api-inference-extension v1),
defined once: the InferencePool kind the operator renders for a service with spec.gateway, the HTTPRoute
that points a Gateway at it, the Endpoint Picker's (EPP) port, and the request headers a GIE gateway sets
that the picker maps onto gpufleet's tenants and queue classes (docs/gateway-api.md)."""
from __future__ import annotations

# The InferencePool (v1, the version GIE v1.0 and later serve; its CRD is vendored from GIE_VERSION).
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
INFERENCE_POOL_API_VERSION = f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"
INFERENCE_POOL_CRD = f"{INFERENCE_POOL_PLURAL}.{INFERENCE_POOL_GROUP}"
GIE_VERSION = "v1.5.0"

# The Gateway API itself: the HTTPRoute's CRD comes with the gateway, not with gpufleet.
GATEWAY_GROUP = "gateway.networking.k8s.io"
GATEWAY_KIND = "Gateway"
HTTPROUTE_API_VERSION = f"{GATEWAY_GROUP}/v1"
HTTPROUTE_KIND = "HTTPRoute"

# The router's Endpoint Picker: the gRPC ext_proc port (GIE's EPP uses 9002 too) and the Service the
# chart puts in front of it (router.epp.enabled), which every InferencePool's endpointPickerRef names.
EPP_PORT = 9002
EPP_PORT_NAME = "grpc-epp"
EPP_SERVICE = "gpufleet-router-epp"
# The port of that Service that reaches the routers' OpenAI API: a pool of data path Router targets it.
EPP_SERVICE_HTTP_PORT_NAME = "http"

# The Endpoint Picker protocol (GIE's docs/proposals/004-endpoint-picker-protocol): the header and the
# envoy.lb dynamic metadata that name the picked endpoint(s), the subset hint the gateway may send in its
# filter metadata, and the key under which the gateway reports the endpoint that served.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

# Set by a GIE gateway: the flow (tenant) a request is fair-shared under, and the InferenceObjective it
# asks for (its priority), read by the picker (docs/gateway-api.md, "Fairness and objectives").
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# Set by GIE's body-based router from the request body's `model`: what an HTTPRoute can match a model on.
MODEL_NAME_HEADER = "X-Gateway-Model-Name"
