"""A spec the CRD accepts but whose child the API server refuses, against the
real API server and the real operator: reported in status and once as an
Event, not retried in a loop, and applied at once when the spec is fixed."""
import pytest
import yaml

from tests.integration.test_inferenceservice import API, apply, cond, isvc, manifest, wait_ready
from tests.support.waiting import wait_for

ALLOWED = "registry.gpufleet.test/"
POLICY_MESSAGE = f"engine images must come from {ALLOWED}"


@pytest.fixture
def image_policy(control_plane, namespace):
    """A cluster admission policy no CRD rule can know about: Deployments in the test
    namespace may only run images from one registry (as many clusters require)."""
    name = f"gpufleet-{namespace}-images"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                         "operations": ["CREATE", "UPDATE"],
                                                         "resources": ["deployments"]}]},
                 "validations": [{"expression": f"object.spec.template.spec.containers.all(c, "
                                                f"c.image.startsWith('{ALLOWED}'))",
                                  "message": POLICY_MESSAGE}]}}
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {
                     "kubernetes.io/metadata.name": namespace}}}}}
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([policy, binding]))
    yield
    control_plane.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name,
                          "--ignore-not-found")


async def wait_policy_active(control_plane, namespace):
    def refused():
        probe = control_plane.kubectl("-n", namespace, "create", "deployment", "probe", "--image=busybox",
                                      "--dry-run=server", check=False)
        return probe.returncode != 0 and POLICY_MESSAGE in probe.stderr
    await wait_for(refused, timeout=30, what="the admission policy to take effect")


async def test_a_refused_child_is_reported_once_not_retried_and_applied_when_fixed(
        control_plane, operator, kube, namespace, image_policy):
    await wait_policy_active(control_plane, namespace)
    apply(control_plane, namespace, manifest("chat"))

    async def rejected():
        o = await isvc(kube, namespace, "chat")
        # The isolation audit's one write (Verified) lands too before the object settles.
        return o if cond(o, "Ready").get("reason") == "ChildRejected" and \
            cond(o, "Progressing").get("reason") == "ChildRejected" and \
            cond(o, "Isolated").get("reason") == "Verified" else None
    obj = await wait_for(rejected, timeout=60, what="Ready=False ChildRejected",
                         describe=lambda: isvc(kube, namespace, "chat"))
    ready = cond(obj, "Ready")
    assert ready["status"] == "False" and ready["observedGeneration"] == obj["metadata"]["generation"]
    assert ready["message"].startswith("Deployment chat-engine rejected by the API server: ")
    assert POLICY_MESSAGE in ready["message"]
    assert cond(obj, "Progressing")["reason"] == "ChildRejected"
    # kubectl get shows it in the on-call columns.
    table = control_plane.kubectl("get", "inferenceservice", "chat", "-n", namespace).stdout
    assert "ChildRejected" in table

    # No retry storm: the status settles and the Event is posted once. The Event is awaited
    # (it is posted beside the status write); the object is then watched for a rewrite over a
    # window of several fleet and audit passes (the operator exposes no per-service count of
    # reconciles that would let the test wait for "it looked again and wrote nothing").
    async def rejected_events():
        events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=chat")
        return [e for e in events if e["reason"] == "ChildRejected"] or None
    await wait_for(rejected_events, timeout=30, what="the ChildRejected Event")
    rv = obj["metadata"]["resourceVersion"]
    rewrites = [e["object"]["metadata"]["resourceVersion"] async for e in kube.watch(
        API, "InferenceService", namespace, field_selector="metadata.name=chat", timeout_seconds=8)
        if e["object"]["metadata"]["resourceVersion"] != rv]
    assert not rewrites, f"the status kept being rewritten: {rewrites}"
    events = await rejected_events()
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert POLICY_MESSAGE in events[0]["message"]

    # Fixing the spec applies at once (a new generation is not held back by the backoff).
    apply(control_plane, namespace, manifest("chat", engine={"image": f"{ALLOWED}engine:0.1.0"}))
    # wait_ready's own timeout: the replica starts on a kwok node, as in test_inferenceservice.py
    obj = await wait_ready(kube, namespace, "chat", replicas=1)
    assert cond(obj, "Ready")["reason"] == "AllReplicasReady"
