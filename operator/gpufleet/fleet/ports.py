"""What the fleet loops need from the rest of the operator, as small typed interfaces.

Each loop names only what it uses: the runtime (``runtime.py``) wires the one
``KubeClient``, the ``Controller`` and the ``ReplicaReader`` into them, and
tests hand in fakes of the same shape. No loop reaches through an object to
another one.

- ``EventRecorder``: a core/v1 Event about an object (``KubeClient.event``).
- ``StatusWriter``: status fields and conditions of an InferenceService,
  merged over its freshest copy (``Controller.write_status``).
- ``ServiceLocks``: the per-service lock a scaling decision is applied under,
  and the reconcile it runs there (``Controller``).
- ``ObjectLister``, ``ObjectApplier``, ``ObjectApi``: the API verbs a loop uses
  (``KubeClient``).
- ``ReplicaSource``, ``DemandSource``, ``AdapterEndpoints``: what the replicas report, and
  the adapter sets they are told (``scrape.ReplicaReader``).
- ``Leadership``: whether this replica may act now, and waiting until it may
  (``OperatorRuntime``; absent without leader election).
- ``NameOwners``: which objects lost the model name they claim to another
  (``reconcile.name_conflicts.NameClaimIndex``, fed by the watches).
"""
from __future__ import annotations

import dataclasses
from contextlib import AbstractAsyncContextManager
from typing import Protocol, Sequence

from gpufleet_api import name_claims
from gpufleet_api.guard.adapters import AdapterReport, AdapterSet
from gpufleet_api.guard.demand_prior import DemandPrior

from ..autoscale.signals import ReplicaSample
from ..metrics import OperatorMetrics

Key = tuple[str, str]  # (namespace, name) of an InferenceService


class EventRecorder(Protocol):
    async def event(self, involved: dict, *, reason: str, message: str, type_: str = "Normal") -> None: ...


class StatusWriter(Protocol):
    async def write_status(self, isvc: dict, fields: dict | None = None,
                           conditions: Sequence[dict] = ()) -> None: ...


class ServiceLocks(Protocol):
    def locked(self, namespace: str, name: str) -> AbstractAsyncContextManager[dict | None]:
        """Hold the service's lock; its freshest copy, None when it is gone or going."""
        ...

    async def reconcile_locked(self, isvc: dict, apply_children: bool = True) -> None: ...


class ObjectLister(Protocol):
    async def list(self, api_version: str, kind: str, namespace: str | None = None, *,
                   label_selector: str | None = None, field_selector: str | None = None) -> list[dict]: ...


class ObjectApplier(Protocol):
    async def apply(self, obj: dict, *, field_manager: str = ...) -> dict: ...


class ObjectApi(ObjectApplier, Protocol):
    """The verbs a service loop uses besides status: scale-in marks, the audit request's
    annotation, reads, and the pod deletion of remediation."""

    async def merge_patch(self, api_version: str, kind: str, name: str, patch: dict,
                          namespace: str | None = None, subresource: str | None = None) -> dict: ...

    async def get_or_none(self, api_version: str, kind: str, name: str,
                          namespace: str | None = None) -> dict | None: ...

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool: ...


class DemandSource(Protocol):
    async def demand(self, pod: str, ip: str) -> DemandPrior | None: ...


class AdapterEndpoints(Protocol):
    """A replica's guard's ``GET`` and ``PUT /adapters`` (contract/adapters.py)."""

    async def adapters(self, pod: str, ip: str) -> tuple[AdapterReport | None, str | None]: ...

    async def put_adapters(self, pod: str, ip: str, wanted: AdapterSet) -> str | None: ...


class ReplicaSource(DemandSource, AdapterEndpoints, Protocol):
    async def sample(self, pod: str, ip: str) -> ReplicaSample: ...

    async def audit(self, pod: str, ip: str) -> tuple[dict | None, str | None]: ...


class NameOwners(Protocol):
    def conflict(self, kind: str, namespace: str, name: str) -> name_claims.Conflict | None: ...


class Leadership(Protocol):
    def acting(self) -> bool: ...

    async def wait_leading(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ServicePorts:
    """Everything one service's loop (``service_loop.ServiceLoop``) and its collaborators talk to."""
    events: EventRecorder
    status: StatusWriter
    locks: ServiceLocks
    objects: ObjectApi
    replicas: ReplicaSource
    metrics: OperatorMetrics
    names: NameOwners = name_claims.EMPTY   # the InferenceAdapters' NameConflict conditions
