"""Thin kopf wiring: events in, ``Controller.reconcile`` out.

kopf keeps its bookkeeping in annotations (never in status), posts no events
of its own, and runs with explicit watch/request timeouts and a bounded
worker pool. Changes to child objects (a hand-edited Deployment, a pod that
became ready) are mapped to their owner and reconciled through a debounced
queue, so drift is repaired in seconds without a reconcile per pod event.
"""
from __future__ import annotations

import asyncio
import logging

import kopf

from .api import v1alpha1 as t
from .kube.errors import ApiError
from .kube.pods import is_ready
from .manifests import names
from .runtime import OperatorRuntime

log = logging.getLogger(__name__)
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGER}
DEBOUNCE_SECONDS = 0.2  # collect a burst of child events into one reconcile


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
def login(memo: kopf.Memo, **_) -> kopf.ConnectionInfo:
    cfg = _rt(memo).kube.config
    return kopf.ConnectionInfo(server=cfg.server, ca_path=cfg.ca_file, certificate_path=cfg.cert_file,
                               private_key_path=cfg.key_file, token=cfg.bearer_token(),
                               insecure=cfg.insecure, default_namespace=cfg.namespace)


async def _reconcile(body, memo) -> None:
    try:
        await _rt(memo).controller.reconcile(dict(body))
    except ApiError as e:
        if e.transient:
            raise kopf.TemporaryError(f"transient API error: {e}", delay=5) from e
        raise kopf.TemporaryError(f"API error: {e}", delay=30) from e


@kopf.on.create(t.GROUP, t.VERSION, t.PLURAL)
@kopf.on.update(t.GROUP, t.VERSION, t.PLURAL)
@kopf.on.resume(t.GROUP, t.VERSION, t.PLURAL)
async def reconcile_service(body, memo: kopf.Memo, **_) -> None:
    await _reconcile(body, memo)


@kopf.timer(t.GROUP, t.VERSION, t.PLURAL, interval=30, idle=10)
async def resync_service(body, memo: kopf.Memo, **_) -> None:
    # Level-based backstop: whatever was missed, the next tick puts right.
    await _reconcile(body, memo)


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
async def engine_pod_changed(body, namespace, memo: kopf.Memo, **_) -> None:
    service = body.get("metadata", {}).get("labels", {}).get(names.LABEL_SERVICE)
    if service:
        _rt(memo).trigger(namespace, service)


@kopf.index("", "v1", "pods", labels={names.LABEL_NAME: names.ENGINE_APP})
def engine_pods(name, namespace, labels, status, meta, **_):
    """Engine pods by (namespace, service), kept current from the watch stream."""
    service = labels.get(names.LABEL_SERVICE)
    if not service:
        return None
    return {(namespace, service): {"name": name, "ip": status.get("podIP"), "ready": is_ready(status),
                                   "deleting": bool(meta.get("deletionTimestamp"))}}


@kopf.daemon(t.GROUP, t.VERSION, t.PLURAL, cancellation_timeout=5)
async def fleet_daemon(stopped, body, namespace, name, memo: kopf.Memo, engine_pods: kopf.Index, **_) -> None:
    """Per-service loop: replica metrics → autoscaling, status metrics, fragmentation audits."""
    from .fleet.service_loop import ServiceLoop
    rt = _rt(memo)
    if not rt.fleet_enabled:
        return
    loop = ServiceLoop(rt, namespace, name)
    while not stopped:
        try:
            pods = list(engine_pods.get((namespace, name), []))
            await loop.tick(_plain(body), pods)
        except ApiError as e:
            log.warning("fleet loop for %s/%s: %s", namespace, name, e)
        except Exception:
            log.exception("fleet loop for %s/%s crashed; continuing", namespace, name)
        await stopped.wait(rt.fleet_interval)


def _plain(body) -> dict:
    """A detached plain-dict copy of kopf's live body."""
    import copy
    return copy.deepcopy(dict(body))


async def run_triggered(rt: OperatorRuntime) -> None:
    """Reconcile owners of changed children, each at most once per burst."""
    while True:
        keys = await rt.next_triggered()
        await asyncio.sleep(DEBOUNCE_SECONDS)
        keys |= rt.drain_triggered()
        for ns, name in sorted(keys):
            try:
                isvc = await rt.controller.get(ns, name)
                if isvc and not isvc["metadata"].get("deletionTimestamp"):
                    await rt.controller.reconcile(isvc)
            except ApiError as e:
                log.warning("reconcile of %s/%s after a child change failed: %s", ns, name, e)
            except Exception:
                log.exception("reconcile of %s/%s after a child change crashed", ns, name)
