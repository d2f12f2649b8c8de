"""spec.gateway through the controller (wiring/gateway.py) against the fake API server: the InferencePool and the
HTTPRoute applied beside the other children, what a gateway wrote in the pool's status.parents copied into the
service's status, and what stands in the way (the GIE CRD not installed, no EPP Service in the namespace, a name
held by another object) reported as GatewayReady=False without failing the rest of the reconcile."""
from __future__ import annotations

import copy

import pytest

from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile import gateway_status as gs
from gpufleet.wiring.controller import Controller
from gpufleet_api import gateway_api as gie
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"
EPP_SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": gie.EPP_SERVICE, "namespace": "ml"},
               "spec": {"selector": {"app.kubernetes.io/name": "gpufleet-router"},
                        "ports": [{"name": gie.EPP_PORT_NAME, "port": gie.EPP_PORT, "targetPort": gie.EPP_PORT},
                                  {"name": "http", "port": 80, "targetPort": 8000}]}}
PARENT = {"name": "inference", "namespace": "gateways"}


class Kube(FakeKube):
    """The fake API server, with kinds that may be absent (the GIE or Gateway API CRDs not installed)."""

    def __init__(self):
        super().__init__()
        self.missing: set[str] = set()

    async def has_kind(self, api_version: str, kind: str) -> bool:
        return kind not in self.missing and await super().has_kind(api_version, kind)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def isvc(gateway: dict | None, generation: int = 1, **spec) -> dict:
    body = {"model": {"name": "org/m"}, **spec}
    if gateway is not None:
        body["gateway"] = gateway
    return {"apiVersion": API, "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "u-chat", "generation": generation},
            "spec": body, "status": {}}


@pytest.fixture
def kube():
    k = Kube()
    k.put(EPP_SERVICE)
    return k


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def controller(kube, clock):
    return Controller(kube, OperatorMetrics(), clock=clock)


def status(kube) -> dict:
    return kube.obj("InferenceService", "chat")["status"]


def gateway_ready(kube) -> dict:
    return {x["type"]: x for x in status(kube).get("conditions") or []}[gs.GATEWAY_READY]


def applied(kube) -> list[tuple[str, str]]:
    return [(key[0], key[2]) for verb, key, _ in kube.writes if verb == "apply"]


def accepted_by(gateway: str, accepted: str = "True", refs: str = "True", message: str = "") -> dict:
    return {"parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway,
                          "namespace": "gateways"},
            "controllerName": "istio.io/gateway-controller",
            "conditions": [{"type": "Accepted", "status": accepted, "reason": "Accepted" if accepted == "True"
                            else "NotSupportedByParent", "message": message,
                            "lastTransitionTime": "2026-01-01T00:00:00Z"},
                           {"type": "ResolvedRefs", "status": refs, "reason": "ResolvedRefs" if refs == "True"
                            else "InvalidExtensionRef", "message": message,
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}


async def test_the_pool_and_route_are_applied_beside_the_other_children(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    assert {("InferencePool", "chat"), ("HTTPRoute", "chat"), ("Deployment", "chat-engine")} <= set(applied(kube))
    pool = kube.obj("InferencePool", "chat")
    assert pool["spec"]["endpointPickerRef"]["name"] == gie.EPP_SERVICE
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "u-chat"
    assert kube.obj("HTTPRoute", "chat")["spec"]["parentRefs"][0]["name"] == "inference"
    assert status(kube)["gateway"] == {"inferencePool": "chat", "httpRoute": "chat", "dataPath": "Direct",
                                       "parents": []}
    ready = gateway_ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", gs.AWAITING_GATEWAY)
    assert "kubectl describe httproute chat" in ready["message"]
    assert {x["type"]: x for x in status(kube)["conditions"]}[c.READY]["reason"] == "EngineStarting"


async def test_no_route_without_a_parent_gateway(kube, controller):
    kube.put(isvc({}))
    await controller.reconcile_key("ml", "chat")
    assert ("InferencePool", "chat") in applied(kube) and kube.obj("HTTPRoute", "chat") is None
    assert "httpRoute" not in status(kube)["gateway"]
    assert "attach it with an HTTPRoute of your own" in gateway_ready(kube)["message"]


async def test_no_gateway_section_no_pool_and_no_condition(kube, controller):
    kube.put(isvc(None))
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("InferencePool", "chat") is None and "gateway" not in status(kube)
    assert gs.GATEWAY_READY not in {x["type"] for x in status(kube)["conditions"]}


async def test_a_missing_inferencepool_crd_is_reported_and_the_rest_is_applied(kube, controller, clock):
    kube.missing.add(gie.INFERENCE_POOL_KIND)
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    ready = gateway_ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", "InferencePoolCRDMissing")
    assert "gateway.crds=true" in ready["message"] and "v1.5.0" in ready["message"]
    assert ("Deployment", "chat-engine") in applied(kube) and ("Service", "chat") in applied(kube)
    assert not any(kind in ("InferencePool", "HTTPRoute") for kind, _ in applied(kube))
    assert "gateway" not in status(kube)
    # Installed later: found again once the rediscovery interval has passed.
    kube.missing.clear()
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("InferencePool", "chat") is None   # not asked again within the minute
    clock.now += 61
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("InferencePool", "chat") is not None
    assert gateway_ready(kube)["reason"] == gs.AWAITING_GATEWAY


async def test_a_missing_httproute_crd_leaves_the_pool_and_says_so(kube, controller):
    kube.missing.add(gie.HTTPROUTE_KIND)
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("InferencePool", "chat") is not None and kube.obj("HTTPRoute", "chat") is None
    assert gateway_ready(kube)["reason"] == "HTTPRouteCRDMissing"


async def test_no_epp_service_in_the_namespace_is_reported_with_the_fix(kube, controller):
    await kube.delete("v1", "Service", gie.EPP_SERVICE, "ml")
    kube.put(isvc({}))
    await controller.reconcile_key("ml", "chat")
    ready = gateway_ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", "EndpointPickerMissing")
    assert f"no Service {gie.EPP_SERVICE}" in ready["message"] and "router.epp.enabled=true" in ready["message"]
    assert kube.obj("InferencePool", "chat") is None and ("Deployment", "chat-engine") in applied(kube)


async def test_a_router_pool_takes_the_routers_pods_from_the_epp_service(kube, controller):
    kube.put(isvc({"dataPath": "Router", "failureMode": "FailOpen"}))
    await controller.reconcile_key("ml", "chat")
    pool = kube.obj("InferencePool", "chat")
    assert pool["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gpufleet-router"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert status(kube)["gateway"]["dataPath"] == "Router"


async def test_the_gateways_acceptance_is_copied_into_status(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    pool = kube.obj("InferencePool", "chat")
    kube.put({**pool, "status": {"parents": [accepted_by("inference")]}})
    await controller.reconcile_key("ml", "chat", apply_children=False)
    gateway = status(kube)["gateway"]
    assert gateway["acceptedBy"] == "gateways/inference"
    assert gateway["parents"] == [{
        "kind": "Gateway", "name": "inference", "namespace": "gateways",
        "controllerName": "istio.io/gateway-controller",
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""},
                       {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs", "message": ""}]}]
    ready = gateway_ready(kube)
    assert (ready["status"], ready["reason"]) == ("True", "Accepted")
    assert "accepted by gateways/inference" in ready["message"]


async def test_a_gateways_refusal_is_reported_in_its_words(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    pool = kube.obj("InferencePool", "chat")
    kube.put({**pool, "status": {"parents": [accepted_by("inference", refs="False",
                                                         message="Service gpufleet-router-epp not found")]}})
    await controller.reconcile_key("ml", "chat", apply_children=False)
    ready = gateway_ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", gs.REFS_UNRESOLVED)
    assert "Gateway gateways/inference says ResolvedRefs=False (InvalidExtensionRef): Service gpufleet-router-epp " \
           "not found" == ready["message"]
    assert "acceptedBy" not in status(kube)["gateway"]


async def test_a_pool_of_the_same_name_that_is_not_ours_is_left_alone(kube, controller):
    theirs = {"apiVersion": gie.INFERENCE_POOL_API_VERSION, "kind": "InferencePool",
              "metadata": {"name": "chat", "namespace": "ml", "managedFields": [{"manager": "helm"}]},
              "spec": {"selector": {"matchLabels": {"app": "vllm"}}}}
    kube.put(theirs)
    kube.put(isvc({}))
    await controller.reconcile_key("ml", "chat")
    assert kube.obj("InferencePool", "chat")["spec"] == theirs["spec"]
    ready = gateway_ready(kube)
    assert ready["reason"] == "ChildConflict" and "no owner; written by helm" in ready["message"]
    assert ("Deployment", "chat-engine") in applied(kube)
    # A status refresh (a pod event) neither writes over it nor reads its status as the service's.
    writes = len(kube.writes)
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert not [w for w in kube.writes[writes:] if w[1][0] == "InferencePool"]
    assert gateway_ready(kube)["reason"] == "ChildConflict" and "gateway" not in status(kube)
    # Once the name is free, the pool is rendered at the next reconcile.
    await kube.delete(gie.INFERENCE_POOL_API_VERSION, "InferencePool", "chat", "ml")
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert kube.obj("InferencePool", "chat")["metadata"]["ownerReferences"][0]["uid"] == "u-chat"
    assert gateway_ready(kube)["reason"] == gs.AWAITING_GATEWAY


async def test_removing_spec_gateway_deletes_the_pool_and_route(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    current = copy.deepcopy(kube.obj("InferenceService", "chat"))
    del current["spec"]["gateway"]
    current["metadata"]["generation"] = 2
    kube.put(current)
    await controller.reconcile_key("ml", "chat")
    assert kube.deleted("InferencePool") == ["chat"] and kube.deleted("HTTPRoute") == ["chat"]
    assert "gateway" not in status(kube)
    assert gateway_ready(kube)["reason"] == gs.NO_GATEWAY
    writes = len(kube.writes)
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert not [w for w in kube.writes[writes:] if w[1][0] in ("InferencePool", "HTTPRoute")]


async def test_dropping_the_parent_deletes_the_route_only(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    current = copy.deepcopy(kube.obj("InferenceService", "chat"))
    current["spec"]["gateway"] = {}
    current["metadata"]["generation"] = 2
    kube.put(current)
    await controller.reconcile_key("ml", "chat")
    assert kube.deleted("HTTPRoute") == ["chat"] and kube.obj("InferencePool", "chat") is not None
    assert "httpRoute" not in status(kube)["gateway"]


async def test_a_disaggregated_service_with_direct_is_invalid_naming_the_field(kube, controller):
    kube.put(isvc({"dataPath": "Direct"}, disaggregation={}, engine={"kvTransfer": {}}))
    await controller.reconcile_key("ml", "chat")
    ready = {x["type"]: x for x in status(kube)["conditions"]}[c.READY]
    assert ready["reason"] == "InvalidSpec"
    assert "spec.gateway.dataPath Direct cannot serve spec.disaggregation" in ready["message"]
    assert "set spec.gateway.dataPath to Router" in ready["message"]
    assert kube.obj("InferencePool", "chat") is None


async def test_a_steady_pool_writes_no_status(kube, controller):
    kube.put(isvc({"parentRef": PARENT}))
    await controller.reconcile_key("ml", "chat")
    pool = kube.obj("InferencePool", "chat")
    kube.put({**pool, "status": {"parents": [accepted_by("inference")]}})
    await controller.reconcile_key("ml", "chat", apply_children=False)
    writes = len(kube.writes)
    await controller.reconcile_key("ml", "chat", apply_children=False)
    assert [w for w in kube.writes[writes:] if w[0] == "patch/status"] == []
