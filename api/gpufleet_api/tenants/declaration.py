"""The tenants a platform declares: names, fair-share weights, limits, and how callers are identified.

Declared per namespace, for every InferenceService in it (docs/tenants.md, "Where tenants are
declared"): the Secrets holding a tenant's key hashes live in that namespace, and a team's budget is
one across the models it calls there. ``TenantsSpec`` is the spec of the InferenceTenants kind (its CRD
is generated from these types: ``crd.TENANTS``); ``parse`` reads one the way the other API types are
read (every problem at once, each named by its camelCase path with the fix). An unknown field is
refused, not ignored: a misspelt ``limit`` must not read as "no limit".
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.typed import Invalid, Model, Problem, convert

from ..gateway_api import FAIRNESS_ID_HEADER
from ..schema import rule
from ..v1alpha1.common import DNS_LABEL, SecretKeyRef

# The header a trusted gateway names the tenant in, and the fairness ids of the Gateway API Inference
# Extension / llm-d flow control (the second is its newer name), accepted as the tenant where trusted.
TENANT_HEADER = "x-gpufleet-tenant"
FAIRNESS_ID_HEADERS = (FAIRNESS_ID_HEADER, "x-llm-d-inference-fairness-id")
# The metric label of every caller that is not a declared tenant (labels.py); no tenant may take it.
UNKNOWN_TENANT = "unknown"
MAX_TENANTS = 256
HEADER_NAME = r"^[a-z0-9!#$%&'*+.^_`|~-]+$"  # an HTTP field name (RFC 9110 token), lower case

# Said by ``problems`` and by the CRD's CEL rules alike.
UNKNOWN_NAME_MESSAGE = (f"{UNKNOWN_TENANT!r} is the label of callers who are not a declared tenant; "
                        f"name the tenant otherwise, e.g. {UNKNOWN_TENANT}-team")
KEYS_NEEDED_MESSAGE = ("identity is Keys, so each tenant needs keys: the Secret (name, key) holding its "
                       "key hashes; or set identity: Trusted behind a gateway that authenticates")
KEYS_UNREAD_MESSAGE = "identity is Trusted, so keys are never read; remove keys or set identity: Keys"


class TenantLimits(Model, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one tenant may use; a limit left out is no limit. Over one the tenant gets 429 with a
    Retry-After computed from when its budget refills."""
    requests_per_second: Optional[Annotated[int, Meta(
        description="Requests admitted per second, refilling continuously; a burst of up to one "
                    "second's worth is admitted at once.",
        ge=1, le=1_000_000)]] = None
    tokens_per_minute: Optional[Annotated[int, Meta(
        description="Prompt plus answer tokens per minute, refilling continuously; a burst of up to one "
                    "minute's worth. Charged an estimate at admission, corrected by the real count when "
                    "the answer ends.",
        ge=1, le=1_000_000_000)]] = None
    concurrent_requests: Optional[Annotated[int, Meta(
        description="Requests of the tenant in flight at once.",
        ge=1, le=1_000_000)]] = None


class Tenant(Model, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One team sharing the fleet."""
    name: Annotated[str, Meta(
        description="The tenant's name: the label its usage is counted under.",
        pattern=DNS_LABEL, min_length=1, max_length=63,
        extra_json_schema={"x-kubernetes-validations": [rule(
            f"self != '{UNKNOWN_TENANT}'", UNKNOWN_NAME_MESSAGE)]})]
    weight: Annotated[int, Meta(
        description="Fair share under saturation, relative to the other tenants of the same queue "
                    "class: a tenant of weight 2 is served twice the tokens of one of weight 1 while both "
                    "wait.",
        ge=1, le=1000)] = 1
    limits: Annotated[TenantLimits, Meta(
        description="Rate and concurrency limits.")] = msgspec.field(default_factory=TenantLimits)
    keys: Optional[Annotated[SecretKeyRef, Meta(
        description="With identity Keys: the Secret key holding the tenant's API key hashes, one per "
                    "line (docs/tenants.md, \"Keys\"); several during a rotation.")]] = None


class TrustedIdentity(Model, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """With identity Trusted: where the gateway in front names the tenant."""
    tenant_header: Annotated[str, Meta(
        description="The header the gateway sets to the tenant's name (it must drop the one clients send).",
        pattern=HEADER_NAME, min_length=1, max_length=128)] = TENANT_HEADER
    fairness_id: Annotated[Literal["Ignore", "AsTenant"], Meta(
        description="AsTenant: a request without the tenant header is the tenant its "
                    "x-gateway-inference-fairness-id (or x-llm-d-inference-fairness-id) header names, as "
                    "set by a Gateway API Inference Extension gateway. Ignore: only the tenant header "
                    "counts.")] = "Ignore"


class TenantsSpec(Model, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The tenants of one namespace and how their callers are identified."""
    # What ``problems`` says of a parsed spec, said by the API server too so `kubectl apply` refuses it (a
    # duplicate name it refuses by the list's map key).
    __schema__ = {"x_kubernetes_validations": [
        rule("self.identity != 'Keys' || self.tenants.all(t, has(t.keys))", KEYS_NEEDED_MESSAGE,
             field_path=".tenants"),
        rule("self.identity != 'Trusted' || self.tenants.all(t, !has(t.keys))", KEYS_UNREAD_MESSAGE,
             field_path=".tenants"),
    ]}
    identity: Annotated[Literal["Keys", "Trusted"], Meta(
        description="Keys: a caller sends Authorization: Bearer <key>, checked against the hashes in each "
                    "tenant's Secret; no valid key, 401. Trusted: a gateway in front authenticates callers "
                    "and names the tenant in a header (trusted).")] = "Keys"
    trusted: Annotated[TrustedIdentity, Meta(
        description="Identity Trusted: the headers.")] = msgspec.field(default_factory=TrustedIdentity)
    tenants: Annotated[list[Tenant], Meta(
        description="The tenants.",
        min_length=1, max_length=MAX_TENANTS,
        extra_json_schema={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )]

    def by_name(self) -> dict[str, Tenant]:
        return {t.name: t for t in self.tenants}


def parse(raw: Any) -> TenantsSpec:
    """``raw`` (decoded YAML/JSON) as a TenantsSpec; raises Invalid naming every problem and its fix."""
    spec = convert(TenantsSpec, raw)
    found = problems(spec)
    if found:
        raise Invalid(found)
    return spec


def problems(spec: TenantsSpec) -> list[Problem]:
    """What the types alone cannot say: names unique and not the unknown label, keys where identity
    is Keys and only there."""
    out: list[Problem] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(spec.tenants):
        if t.name == UNKNOWN_TENANT:
            out.append(Problem(("tenants", i, "name"), UNKNOWN_NAME_MESSAGE))
        if t.name in seen:
            out.append(Problem(("tenants", i, "name"),
                               f"{t.name!r} is already the name of tenants[{seen[t.name]}]; each tenant needs "
                               "its own name (merge the two or rename one)"))
        seen.setdefault(t.name, i)
        if spec.identity == "Keys" and t.keys is None:
            out.append(Problem(("tenants", i, "keys"), KEYS_NEEDED_MESSAGE))
        if spec.identity == "Trusted" and t.keys is not None:
            out.append(Problem(("tenants", i, "keys"), KEYS_UNREAD_MESSAGE))
    return out
