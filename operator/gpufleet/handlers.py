"""Thin kopf wiring: events in, ``Controller.reconcile`` out.

kopf keeps its bookkeeping in annotations (never in status), posts no events
of its own, and runs with explicit watch/request timeouts and a bounded
worker pool. Changes to child objects (a hand-edited Deployment, a pod that
became ready) are mapped to their owner and reconciled through a debounced
queue, so drift is repaired in seconds without a reconcile per pod event.
"""
from __future__ import annotations

import logging
import time

import kopf

from .api import v1alpha1 as t
from .fleet.service_loop import DELETION_COST
from .kube.errors import ApiError
from .kube.pods import is_ready
from .manifests import names
from .runtime import OperatorRuntime

log = logging.getLogger(__name__)
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGER}
ERROR_BACKOFF_MAX_S = 600


def _rt(memo) -> OperatorRuntime:
    return memo.runtime


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="gpufleet.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="gpufleet.dev", key="last-handled-configuration")
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.batching.worker_limit = memo.worker_limit
    settings.execution.max_workers = 8
    rt: OperatorRuntime = memo.runtime
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


async def _reconcile(body, memo, retry: int = 0) -> None:
    try:
        await _rt(memo).controller.reconcile(dict(body))
    except ApiError as e:
        if e.namespace_terminating:
            # Nothing can be created there any more and the object goes with its
            # namespace; retrying would hold a worker for nothing.
            log.info("%s/%s: namespace is being deleted; not reconciling", body["metadata"].get("namespace"),
                     body["metadata"].get("name"))
            return
        if e.transient:
            raise kopf.TemporaryError(f"transient API error: {e}", delay=5) from e
        # Refused children are reported in status by the controller; what is left
        # (a kind that is not served, credentials) is not fixed by asking again soon.
        raise kopf.TemporaryError(f"API error: {e}", delay=min(ERROR_BACKOFF_MAX_S, 30 * 2 ** retry)) from e


@kopf.on.create(t.GROUP, t.VERSION, t.PLURAL)
@kopf.on.update(t.GROUP, t.VERSION, t.PLURAL)
@kopf.on.resume(t.GROUP, t.VERSION, t.PLURAL)
async def reconcile_service(body, memo: kopf.Memo, retry: int = 0, **_) -> None:
    await _reconcile(body, memo, retry)


@kopf.timer(t.GROUP, t.VERSION, t.PLURAL, interval=30, idle=10)
async def resync_service(body, namespace, name, memo: kopf.Memo, retry: int = 0, **_) -> None:
    # Level-based backstop: whatever the watches missed, the next resync puts right.
    # Child and pod events already reconcile within a second, so a service that
    # was reconciled recently is left alone (at 1000 services a 30 s resync of
    # every one would be 33 reconciles a second of pure re-application).
    if _rt(memo).resync_due(namespace, name, time.monotonic()):
        await _reconcile(body, memo, retry)


@kopf.on.event(t.GROUP, t.VERSION, t.PLURAL)
async def service_seen(type, body, namespace, name, memo: kopf.Memo, **_) -> None:
    """Keep the fleet loop's copy of every InferenceService current."""
    fleet = _rt(memo).fleet
    if fleet is None:
        return
    if type == "DELETED":
        fleet.remove_service(namespace, name)
    else:
        fleet.upsert_service(dict(body))


@kopf.on.delete(t.GROUP, t.VERSION, t.PLURAL, optional=True)
async def forget_service(name, namespace, memo: kopf.Memo, **_) -> None:
    # Children go with the owner through ownerReferences (garbage collector).
    _rt(memo).forget(namespace, name)


def _owner_service(body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == t.KIND and ref.get("apiVersion", "").startswith(t.GROUP):
            return ref["name"]
    return None


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def child_changed(body, namespace, memo: kopf.Memo, **_) -> None:
    owner = _owner_service(body)
    if owner:
        _rt(memo).trigger(namespace, owner)


@kopf.on.event("", "v1", "pods", labels={names.LABEL_NAME: names.ENGINE_APP})
async def engine_pod_changed(type, body, name, namespace, memo: kopf.Memo, **_) -> None:
    """Reconcile the owner (status follows its pods) and keep the fleet loop's pod view current."""
    service = body.get("metadata", {}).get("labels", {}).get(names.LABEL_SERVICE)
    if not service:
        return
    rt = _rt(memo)
    rt.trigger(namespace, service, apply=False)
    if rt.fleet is not None:
        status = body.get("status") or {}
        rt.fleet.upsert_pod(namespace, service, name, None if type == "DELETED" else {
            "ip": status.get("podIP"), "ready": is_ready(status),
            "deleting": bool(body.get("metadata", {}).get("deletionTimestamp")),
            "marked": DELETION_COST in (body.get("metadata", {}).get("annotations") or {})})
