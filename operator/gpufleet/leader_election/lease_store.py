"""Reading, writing and watching one coordination.k8s.io/v1 Lease.

Updates are PUTs carrying the resourceVersion they were computed from, so two
candidates racing for the same Lease cannot both win: the second gets 409
(``Conflict``), as does a create that finds the Lease already there.
"""
from __future__ import annotations

from typing import AsyncIterator

from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.errors import NotFound

from .records import LeaseRecord

API_VERSION = "coordination.k8s.io/v1"
KIND = "Lease"


def record_of(obj: dict) -> LeaseRecord:
    spec = obj.get("spec") or {}
    return LeaseRecord(holder=spec.get("holderIdentity") or None,
                       lease_duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
                       transitions=int(spec.get("leaseTransitions") or 0),
                       acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                       resource_version=obj.get("metadata", {}).get("resourceVersion"))


def lease_object(namespace: str, name: str, record: LeaseRecord) -> dict:
    spec: dict = {"leaseDurationSeconds": record.lease_duration_seconds, "leaseTransitions": record.transitions,
                  "holderIdentity": record.holder or "", "acquireTime": record.acquire_time,
                  "renewTime": record.renew_time}
    meta: dict = {"name": name, "namespace": namespace}
    if record.resource_version:
        meta["resourceVersion"] = record.resource_version
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
            "spec": {k: v for k, v in spec.items() if v is not None}}


async def get_lease(kube: KubeClient, namespace: str, name: str) -> dict | None:
    """The Lease object ``namespace/name``, or None where there is none. A GET in one namespace:
    what a namespaced or read-only identity may do where listing Leases cluster-wide is forbidden."""
    try:
        return await kube.get(API_VERSION, KIND, name, namespace)
    except NotFound:
        return None


class LeaseStore:
    def __init__(self, kube: KubeClient, namespace: str, name: str):
        self.kube = kube
        self.namespace = namespace
        self.name = name

    @property
    def involved(self) -> dict:
        """The Lease as an Event's involvedObject."""
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": self.name, "namespace": self.namespace}}

    async def read(self, timeout: float | None = None) -> LeaseRecord | None:
        path = await self.kube.path(API_VERSION, KIND, self.namespace, self.name)
        try:
            return record_of(await self.kube.request("GET", path, timeout=timeout))
        except NotFound:
            return None

    async def create(self, record: LeaseRecord, timeout: float | None = None) -> LeaseRecord:
        path = await self.kube.path(API_VERSION, KIND, self.namespace)
        obj = lease_object(self.namespace, self.name, record)
        obj["metadata"].pop("resourceVersion", None)
        return record_of(await self.kube.request("POST", path, body=obj, timeout=timeout))

    async def update(self, record: LeaseRecord, timeout: float | None = None) -> LeaseRecord:
        """Replace the Lease; 409 when it changed since ``record.resource_version``."""
        path = await self.kube.path(API_VERSION, KIND, self.namespace, self.name)
        return record_of(await self.kube.request("PUT", path, body=lease_object(self.namespace, self.name, record),
                                                 timeout=timeout))

    async def watch(self, timeout_seconds: int = 300) -> AsyncIterator[LeaseRecord | None]:
        """Each change of the Lease as it happens (None when it is deleted)."""
        async for event in self.kube.watch(API_VERSION, KIND, self.namespace, timeout_seconds=timeout_seconds,
                                           field_selector=f"metadata.name={self.name}"):
            if event.get("type") == "DELETED":
                yield None
            elif event.get("type") in ("ADDED", "MODIFIED"):
                yield record_of(event["object"])
