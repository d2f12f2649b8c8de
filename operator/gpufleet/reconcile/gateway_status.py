"""spec.gateway's status, derived (pure): status.gateway from the InferencePool's status.parents as the gateways
wrote them, and the GatewayReady condition, which says whether a gateway accepted the pool or why nothing could be
rendered (the GIE CRDs missing, no Endpoint Picker Service in the namespace)."""
from __future__ import annotations

from gpufleet_api import gateway_api as gie

from . import conditions as c

GATEWAY_READY = c.GATEWAY_READY
ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
# Reasons of GatewayReady=False.
CRD_MISSING = "InferencePoolCRDMissing"
ROUTE_CRD_MISSING = "HTTPRouteCRDMissing"
PICKER_MISSING = "EndpointPickerMissing"
NOT_ACCEPTED = "NotAccepted"
REFS_UNRESOLVED = "RefsNotResolved"
AWAITING_GATEWAY = "AwaitingGateway"
NO_GATEWAY = "NoGateway"
# Nothing rendered for these: the next reconcile tries again (discovery, the Service read again).
RETRIED = (CRD_MISSING, ROUTE_CRD_MISSING, PICKER_MISSING)

MAX_PARENTS = 32          # as the pool's own status holds
MAX_MESSAGE = 512         # a gateway's message, as much of it as status shows

CRD_MISSING_MESSAGE = (
    f"the {gie.INFERENCE_POOL_KIND} kind ({gie.INFERENCE_POOL_API_VERSION}) is not served by this cluster, so "
    f"no pool is rendered (the rest of the service is): install the chart with gateway.crds=true, or the "
    f"Gateway API Inference Extension's CRDs ({gie.GIE_VERSION}: config/crd/bases/"
    f"{gie.INFERENCE_POOL_GROUP}_{gie.INFERENCE_POOL_PLURAL}.yaml); the operator looks again within a minute")
ROUTE_CRD_MISSING_MESSAGE = (
    f"the {gie.HTTPROUTE_KIND} kind ({gie.HTTPROUTE_API_VERSION}) is not served by this cluster, so no route "
    f"attaches the pool to spec.gateway.parentRef: install your gateway (it brings the Gateway API CRDs), or "
    f"remove spec.gateway.parentRef and attach the pool yourself")


def picker_missing_message(namespace: str, why: str) -> str:
    return (f"{why}: an InferencePool's endpointPickerRef can name only a Service of its own namespace "
            f"({namespace}), so no pool is rendered; install the chart with router.epp.enabled=true in this "
            f"namespace (the {gie.EPP_SERVICE} Service in front of the routers' Endpoint Picker), or serve the "
            f"InferenceService from the namespace where it runs")


def _text(value: object) -> str:
    return str(value or "")[:MAX_MESSAGE]


def parents(pool: dict | None) -> list[dict]:
    """status.gateway.parents: the pool's status.parents, each parent with its conditions (type, status, reason,
    message), at most ``MAX_PARENTS``."""
    out = []
    for entry in ((pool or {}).get("status") or {}).get("parents") or []:
        if not isinstance(entry, dict):
            continue
        ref = entry.get("parentRef") or {}
        if not ref.get("name") or ref.get("kind") == "Status":  # pre-v1 "no parent" placeholder
            continue
        row: dict = {"kind": _text(ref.get("kind") or gie.GATEWAY_KIND), "name": _text(ref["name"])}
        if ref.get("namespace"):
            row["namespace"] = _text(ref["namespace"])
        if entry.get("controllerName"):
            row["controllerName"] = _text(entry["controllerName"])
        row["conditions"] = [{"type": _text(cond.get("type")), "status": _text(cond.get("status")),
                              "reason": _text(cond.get("reason")), "message": _text(cond.get("message"))}
                             for cond in entry.get("conditions") or [] if isinstance(cond, dict)]
        out.append(row)
    return out[:MAX_PARENTS]


def _status_of(parent: dict, type_: str) -> dict | None:
    return next((cond for cond in parent["conditions"] if cond["type"] == type_), None)


def _accepted(parent: dict) -> bool:
    accepted, refs = _status_of(parent, ACCEPTED), _status_of(parent, RESOLVED_REFS)
    return accepted is not None and accepted["status"] == "True" and (refs is None or refs["status"] != "False")


def _name(parent: dict, namespace: str) -> str:
    return f"{parent.get('namespace') or namespace}/{parent['name']}"


def gateway_status(*, pool_name: str, route_name: str | None, data_path: str, pool: dict | None,
                   namespace: str) -> dict:
    """status.gateway for a rendered pool (``pool``: as the API server holds it, None before it exists)."""
    rows = parents(pool)
    accepted = [_name(p, namespace) for p in rows if _accepted(p)]
    status: dict = {"inferencePool": pool_name, "dataPath": data_path, "parents": rows}
    if route_name is not None:
        status["httpRoute"] = route_name
    if accepted:
        status["acceptedBy"] = ", ".join(accepted)
    return status


def condition(status: dict, namespace: str, generation: int) -> dict:
    """GatewayReady from status.gateway: True when a gateway accepted the pool with its references resolved;
    else the first parent's refusal in its gateway's words, or that none has taken the pool yet."""
    pool = status["inferencePool"]
    if status.get("acceptedBy"):
        return c.condition(GATEWAY_READY, True, ACCEPTED, f"InferencePool {pool} accepted by "
                           f"{status['acceptedBy']} (data path {status['dataPath']})", generation=generation)
    for parent in status["parents"]:
        for type_, reason in ((ACCEPTED, NOT_ACCEPTED), (RESOLVED_REFS, REFS_UNRESOLVED)):
            cond = _status_of(parent, type_)
            if cond is not None and cond["status"] == "False":
                return c.condition(GATEWAY_READY, False, reason, (
                    f"{parent['kind']} {_name(parent, namespace)} says {type_}=False ({cond['reason']}): "
                    f"{cond['message']}"), generation=generation)
    route = status.get("httpRoute")
    waiting = (f"HTTPRoute {route} attaches it; kubectl describe httproute {route} shows whether the Gateway "
               f"took the route" if route else
               "spec.gateway.parentRef is unset, so attach it with an HTTPRoute of your own (backendRef group "
               f"{gie.INFERENCE_POOL_GROUP}, kind {gie.INFERENCE_POOL_KIND}, name {pool})")
    return c.condition(GATEWAY_READY, False, AWAITING_GATEWAY,
                       f"no gateway has accepted InferencePool {pool} yet: {waiting}", generation=generation)


def problem(reason: str, message: str, generation: int) -> dict:
    return c.condition(GATEWAY_READY, False, reason, message, generation=generation)


def no_gateway(generation: int) -> dict:
    return c.condition(GATEWAY_READY, False, NO_GATEWAY, "spec.gateway is unset: no InferencePool or HTTPRoute",
                       generation=generation)
