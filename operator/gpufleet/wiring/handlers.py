"""Thin kopf wiring: watch events in, the runtime's trigger queue out.

kopf is used for its watches only: every handler here is an event handler,
so kopf keeps no bookkeeping on the objects (no annotations, no finalizers)
and posts no events. That is what lets a follower replica keep its watches
warm without writing anything: the handlers only feed memory and the queue,
and the runtime reconciles from the queue while this replica leads (see
runtime.py). Changes to child objects (a hand-edited Deployment, a pod that
became ready) are mapped to their owner and reconciled through the debounced
queue, so drift is repaired in seconds without a reconcile per pod event.
"""
from __future__ import annotations

import logging

import kopf

from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.pods import is_ready

from ..manifests import names
from ..reconcile.child_events import Action
from .runtime import OperatorRuntime

log = logging.getLogger(__name__)
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGER}


KOPF_IDLE_TIMEOUT_S = 0.5
# The watches whose handlers below filter by label, and the labels: the API server filters them too
# (``watch_selectors``), so foreign ConfigMaps, Services, Deployments, budgets and pods in the watched
# namespaces (cluster-wide: the whole cluster's) never reach kopf, which decoded each one to drop it.
CHILD_RESOURCES = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"),
                   ("policy", "v1", "poddisruptionbudgets"))
ENGINE_PODS = names.ENGINE_POD_LABELS


def _rt(memo) -> OperatorRuntime:
    return memo.runtime


def kopf_queueing(settings: kopf.OperatorSettings):
    """kopf's per-object worker settings: ``settings.queueing`` since kopf 1.45 renamed
    ``settings.batching`` (whose old name now warns)."""
    return settings.queueing if hasattr(settings, "queueing") else settings.batching


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff-base. kopf builds every event's "essence" for the diffs of change handlers (a deep copy
    of the whole body, metadata.managedFields and status included, then another copy of the result):
    with event handlers only, nothing reads it, and at 1000 services those copies were the largest
    part of the operator's CPU. A change handler (on.create, on.update, on.field), daemon or timer
    needs kopf's own storage back (tests/unit/test_kopf_settings.py checks there is none)."""

    def build(self, *, body: kopf.Body, extra_fields=None) -> kopf.BodyEssence:
        return {}

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def watch_selectors(settings: kopf.OperatorSettings) -> None:
    """Server-side label selectors for the child and engine pod watches (kopf ≥ 1.45; before that the
    handlers' own filters alone drop the foreign objects)."""
    selectors = getattr(settings.watching, "label_selectors", None)
    if selectors is None:
        return
    for resource in CHILD_RESOURCES:
        selectors[resource] = names.label_selector(MANAGED)
    selectors["", "v1", "pods"] = names.engine_pods_selector()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    rt = _rt(memo)
    queueing = kopf_queueing(settings)
    queueing.worker_limit = rt.settings.worker_limit
    # An object's worker ends idle_timeout after its last event, and at most worker_limit run per
    # watch stream (the next object's worker starts when one ends): a listing goes through at about
    # worker_limit / idle_timeout objects a second. kopf's default 5 s made that 20 a second at 100
    # workers, as measured: 1000 services with their pods and children took minutes to be known, so
    # a replica started (or restarted after a crash) could not take over with the whole fleet in
    # view. 0.5 s gives 200 a second; a worker that ends early costs only a new task when its
    # object's next event comes (the handlers are quick event handlers).
    queueing.idle_timeout = KOPF_IDLE_TIMEOUT_S
    settings.execution.max_workers = 8
    watch_selectors(settings)
    settings.persistence.diffbase_storage = NoDiffBase()
    await rt.start()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    await _rt(memo).stop()


@kopf.on.login()
async def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    """kopf's own client logs in with the operator's credentials. kopf calls this
    again only when its copy expired or was refused (401): then reload them,
    unless the operator's client already did."""
    kube = _rt(memo).kube
    handed = memo.get("login_generation")
    creds = await (kube.credentials() if handed is None else kube.reload_credentials(unless_newer_than=handed))
    memo.login_generation = creds.generation
    return kopf.ConnectionInfo(server=creds.server, ca_path=creds.ca_file, certificate_path=creds.cert_file,
                               private_key_path=creds.key_file, scheme=creds.scheme, token=creds.token,
                               insecure=creds.insecure, proxy_url=creds.proxy, default_namespace=creds.namespace,
                               expiration=creds.renew_at)


def spec_unhandled(type: str | None, body) -> bool:
    """Apply the children for this event: the service is new to this replica (the initial
    listing, as after a restart, or a creation), or its spec changed since status last said
    it was handled. Status-only changes (the operator's own writes) need no reconcile."""
    if type in (None, "ADDED"):
        return True
    return body.get("metadata", {}).get("generation") != (body.get("status") or {}).get("observedGeneration")


@kopf.on.event(t.GROUP, t.VERSION, t.PLURAL)
async def service_event(type, body, namespace, name, memo: kopf.Memo, **_) -> None:
    """Keep the runtime's copy of every InferenceService current, and ask for a reconcile
    when its spec needs handling."""
    rt = _rt(memo)
    if type == "DELETED":
        # Children go with the owner through ownerReferences (garbage collector).
        rt.forget(namespace, name)
        return
    rt.service_seen(dict(body))
    if not body.get("metadata", {}).get("deletionTimestamp") and spec_unhandled(type, body):
        rt.trigger(namespace, name, apply=True)


@kopf.on.event(t.GROUP, t.VERSION, t.ADAPTER_PLURAL)
async def adapter_event(type, body, namespace, name, memo: kopf.Memo, **_) -> None:
    """Keep the fleet loop's copy of every InferenceAdapter current; a created, changed or deleted
    adapter wakes its service's loop, which places it and tells the replicas."""
    _rt(memo).adapter_changed(namespace, name, None if type == "DELETED" else dict(body))


def _owner_service(body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == t.KIND and ref.get("apiVersion", "").startswith(t.GROUP):
            return ref["name"]
    return None


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def child_changed(type, body, namespace, memo: kopf.Memo, **_) -> None:
    """A child was deleted or changed by someone else: its owner's children are applied again; its status
    moved (a Deployment's rollout): the owner's status is refreshed; the operator's own write: nothing
    (reconcile/child_events.py)."""
    owner = _owner_service(body)
    if not owner:
        return
    rt = _rt(memo)
    action = rt.controller.applied.event(type, body)
    if action is not Action.NOTHING:
        rt.trigger(namespace, owner, apply=action is Action.APPLY)


@kopf.on.event("", "v1", "pods", labels=ENGINE_PODS)
async def engine_pod_changed(type, body, name, namespace, memo: kopf.Memo, **_) -> None:
    """Reconcile the owner (status follows its pods) and keep the fleet loop's pod view current."""
    service = body.get("metadata", {}).get("labels", {}).get(names.LABEL_SERVICE)
    if not service:
        return
    status = body.get("status") or {}
    labels = body.get("metadata", {}).get("labels") or {}
    _rt(memo).pod_placed(namespace, service, name, None if type == "DELETED" else body.get("spec", {}).get("nodeName"))
    _rt(memo).pod_changed(namespace, service, name, None if type == "DELETED" else {
        "ip": status.get("podIP"), "ready": is_ready(status),
        "deleting": bool(body.get("metadata", {}).get("deletionTimestamp")),
        "marked": names.ANNOTATION_DELETION_COST in (body.get("metadata", {}).get("annotations") or {}),
        "role": labels.get(names.LABEL_ROLE, "unified"), "revision": labels.get(names.LABEL_REVISION),
        "track": labels.get(names.LABEL_TRACK)})


@kopf.on.event("", "v1", "nodes")
async def node_changed(type, body, name, memo: kopf.Memo, **_) -> None:
    """A cordon (kubectl drain) starts replacements for the engine pods on the node (docs/drains.md)."""
    _rt(memo).node_changed(name, None if type == "DELETED" else bool(body.get("spec", {}).get("unschedulable")))
