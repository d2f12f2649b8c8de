"""spec.gateway on the cluster: the InferencePool and HTTPRoute applied (server-side, owned by the service like
its other children), the pool's status read back, and what stands in the way reported as GatewayReady instead of
failing the reconcile: the GIE or Gateway API CRDs not installed (discovery, looked at again every minute), no
Endpoint Picker Service in the namespace, a name another object holds, a refusal by the API server. The
builders and the status are pure (``manifests.gateway``, ``reconcile.gateway_status``)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from gpufleet_api import gateway_api as gie
from gpufleet_api import v1alpha1 as t
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import ApiError, NotFound

from ..errors import OperatorError
from ..manifests import gateway as build
from ..manifests import names
from ..reconcile import conditions as cond
from ..reconcile import gateway_status as gs
from ..reconcile.ownership import CHILD_CONFLICT, holder
from ..reconcile.status import CHILD_REJECTED
from .children import refused

log = logging.getLogger(__name__)

REDISCOVER_S = 60.0  # a kind found missing is looked for again after this long
POOL = (gie.INFERENCE_POOL_API_VERSION, gie.INFERENCE_POOL_KIND)
ROUTE = (gie.HTTPROUTE_API_VERSION, gie.HTTPROUTE_KIND)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the reconcile writes: status.gateway (``fields``; None writes nothing) and GatewayReady."""
    fields: dict | None = None
    condition: dict | None = None


class _Problem(OperatorError):
    """What keeps spec.gateway from being rendered: GatewayReady's reason and message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _check_ours(isvc: dict, existing: dict) -> None:
    who = holder(isvc, existing)
    if who is not None:
        raise _Problem(CHILD_CONFLICT, f"{existing.get('kind')} {existing['metadata']['name']} already exists and "
                                       f"is not this InferenceService's ({who}): delete or rename it")


class ServiceGateway:
    def __init__(self, kube: KubeClient, clock: Callable[[], float] = time.monotonic):
        self.kube = kube
        self._clock = clock
        self._missing_since: dict[tuple[str, str], float] = {}  # kind -> when discovery last said it is absent

    async def served(self, kind: tuple[str, str]) -> bool:
        """Whether the API server serves ``kind``; once absent, asked again only every ``REDISCOVER_S``."""
        since = self._missing_since.get(kind)
        if since is not None and self._clock() - since < REDISCOVER_S:
            return False
        if since is not None:
            self.kube.forget_discovery()
        if await self.kube.has_kind(*kind):
            self._missing_since.pop(kind, None)
            return True
        self._missing_since[kind] = self._clock()
        return False

    async def reconcile(self, isvc: dict, spec: t.InferenceServiceSpec, *, apply: bool) -> Outcome:
        """Render (``apply``) or re-read spec.gateway's children, and what status says of them."""
        meta, status = isvc["metadata"], isvc.get("status") or {}
        gen = meta.get("generation", 0)
        before = status.get("gateway") or {}
        if spec.gateway is None:
            if not before and (cond.get(status.get("conditions"), gs.GATEWAY_READY) or
                               {"reason": gs.NO_GATEWAY})["reason"] == gs.NO_GATEWAY:
                return Outcome()  # never had one, or its removal is reported already
            await self._remove(isvc, before.get("inferencePool"), before.get("httpRoute"))
            return Outcome({"gateway": None}, gs.no_gateway(gen))
        previous = cond.get(status.get("conditions"), gs.GATEWAY_READY) or {}
        # A refusal waits for the next apply (a new spec, the resync): no retry on every pod event. A pool gone
        # (deleted by hand, or a name held by another object freed) is rendered again at once.
        apply = apply or previous.get("reason") in gs.RETRIED or previous.get("observedGeneration") != gen
        try:
            fields = await self._render(isvc, spec, before, apply=apply)
        except _Problem as p:
            return Outcome({"gateway": None}, gs.problem(p.reason, p.message, gen))
        route_missing = spec.gateway.parent_ref is not None and "httpRoute" not in fields
        if fields != before:  # a merge patch: a key left out would stay, so a dropped one is written null
            fields = {**{key: None for key in before if key not in fields}, **fields}
        return Outcome({"gateway": fields}, gs.problem(gs.ROUTE_CRD_MISSING, gs.ROUTE_CRD_MISSING_MESSAGE, gen)
                       if route_missing else gs.condition(fields, meta["namespace"], gen))

    async def _render(self, isvc: dict, spec: t.InferenceServiceSpec, before: dict, *, apply: bool) -> dict:
        ns, service = isvc["metadata"]["namespace"], isvc["metadata"]["name"]
        if not await self.served(POOL):
            raise _Problem(gs.CRD_MISSING, gs.CRD_MISSING_MESSAGE)
        pool_name = names.inference_pool_name(service)
        live = None if apply else await self._get(POOL, pool_name, ns)
        if live is not None:
            _check_ours(isvc, live)  # a pool someone else made is not read as this service's
        route_name: str | None = before.get("httpRoute")
        if live is None:
            svc = await self.kube.get_or_none("v1", "Service", gie.EPP_SERVICE, ns)
            if svc is None:
                raise _Problem(gs.PICKER_MISSING, gs.picker_missing_message(ns, f"no Service {gie.EPP_SERVICE}"))
            picker = build.endpoint_picker(svc)
            if isinstance(picker, str):
                raise _Problem(gs.PICKER_MISSING, gs.picker_missing_message(ns, picker))
            why = build.router_problem(spec, picker)
            if why is not None:
                raise _Problem(gs.PICKER_MISSING, gs.picker_missing_message(ns, why))
            live = await self._apply(isvc, build.build_inference_pool(isvc, spec, picker))
            route = build.build_http_route(isvc, spec)
            route_name = None
            if route is not None and await self.served(ROUTE):
                await self._apply(isvc, route)
                route_name = route["metadata"]["name"]
            elif route is None and before.get("httpRoute"):
                await self._remove(isvc, None, before["httpRoute"])
        return gs.gateway_status(pool_name=pool_name, route_name=route_name, data_path=build.data_path(spec),
                                 pool=live, namespace=ns)

    async def _get(self, kind: tuple[str, str], name: str, namespace: str) -> dict | None:
        try:
            return await self.kube.get_or_none(*kind, name, namespace)
        except NotFound:  # the kind went away since discovery
            self._missing_since[kind] = self._clock()
            raise _Problem(gs.CRD_MISSING, gs.CRD_MISSING_MESSAGE) from None

    async def _apply(self, isvc: dict, obj: dict) -> dict:
        """Server-side apply of one child, unless another object holds its name (a pool or route someone else
        made): then, as a refusal by the API server, a _Problem for the condition."""
        kind = (obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        existing = await self._get(kind, meta["name"], meta["namespace"])
        if existing is not None:
            _check_ours(isvc, existing)
        try:
            return await self.kube.apply(obj)
        except NotFound:
            self._missing_since[kind] = self._clock()
            raise _Problem(gs.CRD_MISSING, gs.CRD_MISSING_MESSAGE) from None
        except ApiError as e:
            if not refused(e):
                raise
            log.warning("%s/%s: %s %s refused: %s", meta["namespace"], isvc["metadata"]["name"], obj["kind"],
                        meta["name"], e)
            raise _Problem(CHILD_REJECTED, f"{obj['kind']} {meta['name']} rejected by the API server: "
                                           f"{e.message}") from None

    async def _remove(self, isvc: dict, pool: str | None, route: str | None) -> None:
        """Delete what spec.gateway rendered and no longer wants (only names status said were rendered)."""
        ns = isvc["metadata"]["namespace"]
        for kind, name in ((ROUTE, route), (POOL, pool)):
            if name is None or not await self.served(kind):
                continue
            existing = await self.kube.get_or_none(*kind, name, ns)
            if existing is not None and holder(isvc, existing) is None:
                await self.kube.delete(*kind, name, ns)
                log.info("%s/%s: deleted %s %s (spec.gateway no longer wants it)", ns, isvc["metadata"]["name"],
                         kind[1], name)
