"""An in-memory stand-in for ``KubeClient``: enough of the API server's
behaviour (resourceVersion preconditions, the status subresource, JSON merge
patch, server-side apply, label selectors, Events) for the
operator's control loops to run without a cluster.

Tests steer it with ``reject`` (an object the server refuses), ``pause``
(hold a write until released: interleavings) and read ``objects``/``events``.
"""
from __future__ import annotations

import asyncio
import copy
from typing import Awaitable, Callable

from gpufleet.kube.errors import ApiError, Conflict, NotFound, error_for

Key = tuple[str, str, str]  # kind, namespace, name


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _matches(obj: dict, selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",")))


class FakeKube:
    def __init__(self):
        self.objects: dict[Key, dict] = {}
        self.events: list[dict] = []
        self.writes: list[tuple[str, Key, dict]] = []   # (verb, key, body) in order
        self.reject: dict[tuple[str, str], ApiError] = {}  # (kind, name) -> refused with this error
        self.pause: dict[tuple[str, str], asyncio.Event] = {}  # (kind, name) -> apply waits for it
        self.paused: dict[tuple[str, str], asyncio.Event] = {}  # set when a paused apply is waiting
        self.on_write: Callable[[str, Key, dict], Awaitable[None]] | None = None
        self._rv = 0

    # --- state -------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def put(self, obj: dict) -> dict:
        """Store an object as the server would have it (tests' setup)."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "ml")
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        meta["resourceVersion"] = self._next_rv()
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return copy.deepcopy(obj)

    def obj(self, kind: str, name: str, namespace: str = "ml") -> dict | None:
        return self.objects.get((kind, namespace, name))

    def event_reasons(self, name: str | None = None) -> list[str]:
        return [e["reason"] for e in self.events if name is None or e["involvedObject"]["name"] == name]

    async def _record(self, verb: str, key: Key, body: dict) -> None:
        self.writes.append((verb, key, copy.deepcopy(body)))
        if self.on_write is not None:
            await self.on_write(verb, key, body)

    def deleted(self, kind: str) -> list[str]:
        """Names of the objects of ``kind`` deleted, in order."""
        return [key[2] for verb, key, _ in self.writes if verb == "delete" and key[0] == kind]

    # --- the KubeClient surface the operator uses -------------------------------------

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None,
                  subresource: str | None = None) -> dict:
        obj = self.objects.get((kind, namespace or "", name))
        if obj is None:
            raise NotFound(404, "NotFound", f'{kind} "{name}" not found')
        return copy.deepcopy(obj)

    async def get_or_none(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        try:
            return await self.get(api_version, kind, name, namespace)
        except NotFound:
            return None

    async def list(self, api_version: str, kind: str, namespace: str | None = None, *,
                   label_selector: str | None = None, field_selector: str | None = None) -> list[dict]:
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and (namespace is None or ns == namespace) and _matches(o, label_selector)]

    async def has_kind(self, api_version: str, kind: str) -> bool:
        return kind != "PodMonitor"

    def forget_discovery(self) -> None:
        pass

    async def apply(self, obj: dict, **_) -> dict:
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        gate = self.pause.pop((obj["kind"], meta["name"]), None)  # one write is held, not every one
        if gate is not None:
            self.paused.setdefault((obj["kind"], meta["name"]), asyncio.Event()).set()
            await gate.wait()
        refused = self.reject.get((obj["kind"], meta["name"]))
        if refused is not None:
            raise refused
        await self._record("apply", key, obj)
        old = self.objects.get(key)
        new = copy.deepcopy(obj)
        if old is not None:
            new["metadata"] = {**old["metadata"], **new["metadata"]}
            new["status"] = old.get("status", {})
            if old.get("spec") != new.get("spec"):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        else:
            new["metadata"].setdefault("uid", f"uid-{meta['name']}")
            new["metadata"]["generation"] = 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        return copy.deepcopy(new)

    async def merge_patch(self, api_version: str, kind: str, name: str, patch: dict,
                          namespace: str | None = None, subresource: str | None = None) -> dict:
        key = (kind, namespace or "", name)
        obj = self.objects.get(key)
        if obj is None:
            raise NotFound(404, "NotFound", f'{kind} "{name}" not found')
        want_rv = (patch.get("metadata") or {}).get("resourceVersion")
        if want_rv is not None and want_rv != obj["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", f'Operation cannot be fulfilled on {kind} "{name}": the object has '
                                            f'been modified; please apply your changes to the latest version')
        await self._record(f"patch/{subresource or ''}", key, patch)
        if subresource == "status":
            new = {**obj, "status": merge_patch(obj.get("status") or {}, patch.get("status") or {})}
        else:
            body = {k: v for k, v in patch.items() if k != "status"}
            body.get("metadata", {}).pop("resourceVersion", None)
            new = merge_patch(obj, body)
        new["metadata"] = {**new["metadata"], "resourceVersion": self._next_rv()}
        self.objects[key] = new
        return copy.deepcopy(new)

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None, **_) -> bool:
        key = (kind, namespace or "", name)
        if key not in self.objects:
            return False
        await self._record("delete", key, {})
        del self.objects[key]
        return True

    async def event(self, involved: dict, *, reason: str, message: str, type_: str = "Normal", **_) -> None:
        meta = involved["metadata"]
        self.events.append({"involvedObject": {"name": meta["name"], "namespace": meta.get("namespace")},
                            "reason": reason, "message": message, "type": type_})

    async def request(self, method: str, path: str, *, body=None, **_) -> dict:
        raise error_for(404, {}, f"{method} {path} is not faked")
