"""A model name belongs to the namespace that claimed it first, against the real API server and the real
operator: a second namespace's InferenceService with the first's servedName gets NameConflict=True naming
the first (and one Warning Event), and deleting the first clears it (docs/security.md)."""
import uuid

import pytest

from tests.integration.test_inferenceservice import apply, cond, isvc, manifest
from tests.support.waiting import wait_for

SERVED = "customer-a"


@pytest.fixture
async def two_namespaces(control_plane, kube):
    """Two namespaces whose names sort in creation order: a claim made the same second in both goes to the
    first by the rule's tie-break (namespace), as it would by time."""
    stem = f"t-{uuid.uuid4().hex[:8]}"
    names = [f"{stem}-a", f"{stem}-b"]
    for name in names:
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": name, "labels": {"gpufleet.dev/test": "true"}}})
    yield names
    for name in names:
        await kube.delete("v1", "Namespace", name)


async def test_a_second_namespaces_served_name_gets_name_conflict_until_the_first_is_deleted(
        control_plane, operator, kube, two_namespaces):
    first_ns, second_ns = two_namespaces
    model = {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": SERVED}
    apply(control_plane, first_ns, manifest("first", model=model))
    await wait_for(lambda: isvc(kube, first_ns, "first"), timeout=30, what="the first service")
    apply(control_plane, second_ns, manifest("second", model=model))

    async def conflicted():
        o = await isvc(kube, second_ns, "second")
        return o if cond(o, "NameConflict").get("status") == "True" else None
    obj = await wait_for(conflicted, timeout=60, what="NameConflict=True on the second namespace's service",
                         describe=lambda: isvc(kube, second_ns, "second"))
    conflict = cond(obj, "NameConflict")
    assert conflict["reason"] == "NameClaimedElsewhere"
    assert conflict["message"] == (f"{first_ns}/first already serves model '{SERVED}'; give this InferenceService "
                                   f"another spec.model.servedName")
    assert cond(await isvc(kube, first_ns, "first"), "NameConflict") == {}

    async def warned():
        events = await kube.list("v1", "Event", second_ns, field_selector="involvedObject.name=second")
        return [e for e in events if e["reason"] == "NameConflict"] or None
    events = await wait_for(warned, timeout=30, what="the NameConflict Event")
    assert len(events) == 1 and events[0]["type"] == "Warning" and f"{first_ns}/first" in events[0]["message"]

    await kube.delete("serving.gpufleet.dev/v1alpha1", "InferenceService", "first", first_ns)

    async def cleared():
        o = await isvc(kube, second_ns, "second")
        return o if cond(o, "NameConflict").get("status") == "False" else None
    obj = await wait_for(cleared, timeout=60, what="NameConflict=False once the first service is gone",
                         describe=lambda: isvc(kube, second_ns, "second"))
    assert cond(obj, "NameConflict")["reason"] == "NameOwned"
