"""What the kinds' types share: the API group and version, quantity and name patterns, secret references, status
conditions."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from msgspec import Meta

from gpufleet_api.typed import Model

GROUP = "serving.gpufleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc"]

# A resource quantity that cannot be negative (the Deployment would refuse one):
# Kubernetes' own quantity syntax without the minus sign, and no negative integer.
QUANTITY: dict[str, Any] = {"x-kubernetes-int-or-string": True, "minimum": 0,
            "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                       r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# What Kubernetes accepts as a label value (empty, or up to 63 characters) and as a
# label key or taint key (an optional DNS-subdomain prefix and a name of up to 63).
LABEL_VALUE: dict[str, Any] = {"max_length": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
QUALIFIED_NAME = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# What no client can put in the `model` of an OpenAI request (vLLM takes any other non-empty
# string): ASCII whitespace and control characters, DEL, the C1 controls and the no-break space.
# Written so that Go's RE2 (the API server's CEL) and Python's re read it alike.
SERVED_NAME_FORBIDDEN = r"[\x00-\x20\x7f-\xa0]"
SERVED_NAME_MESSAGE = ("spec.model.servedName must not contain whitespace or control characters: clients send "
                       "it as `model` in OpenAI requests; use e.g. my-model")


class SecretKeyRef(Model, frozen=True, kw_only=True):
    """A key in a Secret in the InferenceService's namespace."""
    name: Annotated[str, Meta(description="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)]
    key: Annotated[str, Meta(description="Key inside the Secret.", min_length=1)] = "token"


# --- status ------------------------------------------------------------------------


class Condition(Model, frozen=True, kw_only=True):
    """A condition in the Kubernetes API conventions' shape."""
    type: Annotated[str, Meta(
        description="Condition type: Ready, Progressing, Degraded, Isolated, Scaling, FragmentationOK, "
                    "NameConflict. Scaling is False while the autoscaler cannot read every replica "
                    "(MetricsUnavailable) or decides on the ready replicas only because others never became ready "
                    "(ReplicasNotReady). NameConflict is True (NameClaimedElsewhere) while another object, in "
                    "the namespace that claimed the model name first, serves it: the router sends this one none "
                    "of its requests; False (NameOwned) once that has gone. GatewayReady (with spec.gateway) is "
                    "True once a gateway accepted the InferencePool with its references resolved; False says why "
                    "not (e.g. InferencePoolCRDMissing, EndpointPickerMissing, NotAccepted).")]
    status: Annotated[Literal["True", "False", "Unknown"], Meta(description="True, False or Unknown.")]
    reason: Annotated[str, Meta(description="CamelCase reason.")]
    message: Annotated[str, Meta(description="What is going on, for a human.")] = ""
    last_transition_time: Annotated[str, Meta(
        description="When status last changed (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]
    observed_generation: Optional[Annotated[int, Meta(
        description="The spec generation the condition describes.")]] = None
