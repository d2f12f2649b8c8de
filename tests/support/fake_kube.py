"""An in-memory stand-in for ``KubeClient``: enough of the API server's
behaviour (resourceVersion preconditions, the status subresource, JSON merge
patch, server-side apply, label selectors, Events) for the
operator's control loops to run without a cluster.

Tests steer it with ``reject`` (an object the server refuses), ``pause``
(hold a write until released: interleavings) and read ``objects``/``events``.
Watches see every change made through it (``watch``, from a ``list_versioned``
version, with bookmarks on request); ``compact()`` forgets the history, so a
watch from an older version gets 410 Gone; ``calls`` counts lists and watches.
"""
from __future__ import annotations

import asyncio
import collections
import copy
from typing import AsyncGenerator, Awaitable, Callable

from gpufleet_kit.kube.errors import ApiError, Conflict, NotFound, error_for

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
        self.calls: collections.Counter = collections.Counter()   # ("get" | "list" | "watch", kind) -> how many
        self.history: list[tuple[int, str, dict]] = []   # (resourceVersion, event type, object) of each change
        self.oldest_rv = 0              # watches from before this version are answered 410 Gone
        self._wakers: set[asyncio.Event] = set()
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
        self._store((obj["kind"], meta["namespace"], meta["name"]), obj)
        return copy.deepcopy(obj)

    def _store(self, key: Key, obj: dict) -> None:
        self._changed("MODIFIED" if key in self.objects else "ADDED", obj)
        self.objects[key] = obj

    def _changed(self, kind: str, obj: dict) -> None:
        self.history.append((int(obj["metadata"]["resourceVersion"]), kind, copy.deepcopy(obj)))
        for wake in self._wakers:
            wake.set()

    def compact(self) -> None:
        """Forget the changes so far, as etcd's compaction does: older versions are gone."""
        self.history.clear()
        self.oldest_rv = self._rv

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
        self.calls["get", kind] += 1
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
        self.calls["list", kind] += 1
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items())
                if k == kind and (namespace is None or ns == namespace) and _matches(o, label_selector)]

    async def list_versioned(self, api_version: str, kind: str, namespace: str | None = None, *,
                             label_selector: str | None = None,
                             field_selector: str | None = None) -> tuple[list[dict], str]:
        return await self.list(api_version, kind, namespace, label_selector=label_selector), str(self._rv)

    async def watch(self, api_version: str, kind: str, namespace: str | None = None, *, timeout_seconds: int = 60,
                    label_selector: str | None = None, field_selector: str | None = None,
                    resource_version: str | None = None,
                    allow_bookmarks: bool = False) -> AsyncGenerator[dict, None]:
        """The changes after ``resource_version`` (without one: every object ADDED first), then each change
        as it is made, until ``timeout_seconds`` pass without one; a BOOKMARK before that end when asked."""
        self.calls["watch", kind] += 1
        if resource_version is None:
            seen = self._rv
            for o in await self.list(api_version, kind, namespace, label_selector=label_selector):
                yield {"type": "ADDED", "object": o}
        else:
            seen = int(resource_version)
            if seen < self.oldest_rv:
                yield {"type": "ERROR", "object": {"kind": "Status", "status": "Failure", "reason": "Expired",
                                                   "message": f"too old resource version: {seen}", "code": 410}}
                return
        while True:
            wake = asyncio.Event()
            self._wakers.add(wake)
            try:
                fresh = [(rv, t, o) for rv, t, o in self.history if rv > seen]
                for rv, t, o in fresh:
                    seen = rv
                    meta = o["metadata"]
                    if o["kind"] == kind and namespace in (None, meta["namespace"]) and _matches(o, label_selector):
                        yield {"type": t, "object": copy.deepcopy(o)}
                if not fresh:
                    try:
                        await asyncio.wait_for(wake.wait(), timeout_seconds)
                    except asyncio.TimeoutError:
                        if allow_bookmarks:
                            yield {"type": "BOOKMARK", "object": {"kind": kind, "metadata": {
                                "resourceVersion": str(self._rv)}}}
                        return
            finally:
                self._wakers.discard(wake)

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
        self._store(key, new)
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
        self._store(key, new)
        return copy.deepcopy(new)

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None, **_) -> bool:
        key = (kind, namespace or "", name)
        if key not in self.objects:
            return False
        await self._record("delete", key, {})
        gone = self.objects.pop(key)
        self._changed("DELETED", {**gone, "metadata": {**gone["metadata"], "resourceVersion": self._next_rv()}})
        return True

    async def event(self, involved: dict, *, reason: str, message: str, type_: str = "Normal", **_) -> None:
        meta = involved["metadata"]
        self.events.append({"involvedObject": {"name": meta["name"], "namespace": meta.get("namespace")},
                            "reason": reason, "message": message, "type": type_})

    async def request(self, method: str, path: str, *, body=None, **_) -> dict:
        raise error_for(404, {}, f"{method} {path} is not faked")
