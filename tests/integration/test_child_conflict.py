"""An object someone else made that holds a child's name, against the real API server and the real
operator: the operator does not take it over (no forced apply), the service says ChildConflict naming
it and the fix, and once the object is deleted the condition clears and the service reconciles."""
from tests.integration.test_inferenceservice import apply, cond, isvc, manifest, wait_ready
from tests.support.waiting import wait_for

TEAM_DATA = {"owner": "the data team", "settings.yaml": "retention: 30d\n"}


async def test_an_unowned_configmap_named_like_the_guard_config_is_left_alone_until_deleted(
        control_plane, operator, kube, namespace):
    await kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "chat-guard", "namespace": namespace}, "data": TEAM_DATA})
    before = await kube.get("v1", "ConfigMap", "chat-guard", namespace)
    apply(control_plane, namespace, manifest("chat"))

    async def conflicted():
        o = await isvc(kube, namespace, "chat")
        return o if cond(o, "ChildConflict").get("status") == "True" else None
    obj = await wait_for(conflicted, timeout=60, what="ChildConflict=True",
                         describe=lambda: isvc(kube, namespace, "chat"))
    message = cond(obj, "ChildConflict")["message"]
    assert message.startswith("ConfigMap chat-guard (no owner")
    assert "Delete or rename that object, or rename the InferenceService" in message
    assert cond(obj, "Ready")["reason"] == "ChildConflict" and cond(obj, "Ready")["status"] == "False"

    async def conflict_events():
        events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=chat")
        return [e for e in events if e["reason"] == "ChildConflict"] or None
    events = await wait_for(conflict_events, timeout=30, what="the ChildConflict Event")
    assert events[0]["type"] == "Warning" and "chat-guard" in events[0]["message"]

    # Not a field of the team's ConfigMap changed, and nothing else of the service was made.
    after = await kube.get("v1", "ConfigMap", "chat-guard", namespace)
    assert after["data"] == TEAM_DATA and after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert not after["metadata"].get("ownerReferences")
    assert await kube.get_or_none("apps/v1", "Deployment", "chat-engine", namespace) is None
    assert await kube.get_or_none("v1", "Service", "chat", namespace) is None

    # The owner deletes it: the operator's timed look (not a watch: the object carries none of its
    # labels) finds the name free within its backoff, applies the children and clears the condition.
    await kube.delete("v1", "ConfigMap", "chat-guard", namespace)

    async def cleared():
        o = await isvc(kube, namespace, "chat")
        return o if cond(o, "ChildConflict").get("status") == "False" else None
    obj = await wait_for(cleared, timeout=90, what="ChildConflict=False",
                         describe=lambda: isvc(kube, namespace, "chat"))
    assert cond(obj, "ChildConflict")["reason"] == "NoConflict"
    cm = await kube.get("v1", "ConfigMap", "chat-guard", namespace)
    assert "guard.json" in cm["data"]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    obj = await wait_ready(kube, namespace, "chat", replicas=1)
    assert cond(obj, "Ready")["reason"] == "AllReplicasReady"
