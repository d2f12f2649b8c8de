"""The objects of one kind, kept current from a LIST and the WATCH that follows it (pure).

``informer.py`` does the I/O; this module decides what each answer means:
``WatchCache.replace`` takes a LIST, ``WatchCache.apply`` one watch event,
``recovery`` says what follows a failed LIST or WATCH, and ``gpufleet_kit.backoff`` how long
to wait before trying again. The API server's side of the protocol is in its
API concepts page ("Efficient detection of changes"): a WATCH resumes from a
resourceVersion; BOOKMARK events move that version on without a change; a
version the server no longer holds is answered 410 Gone (as the status of the
request or as an ERROR event), and only a new LIST recovers from it.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Iterable

GONE = 410   # the resourceVersion is older than the server keeps: LIST again


class Step(enum.Enum):
    CONTINUE = "continue"    # read the next event
    RELIST = "relist"        # the watch's resourceVersion is gone (410): LIST again
    RECONNECT = "reconnect"  # the server ended the watch with another error: WATCH again after a pause


@dataclasses.dataclass(frozen=True)
class Applied:
    step: Step
    changed: bool   # the cache's objects differ from before the event
    status: int | None = None   # an ERROR event's code


def key_of(obj: dict) -> str:
    """``namespace/name`` (``name`` for a cluster-scoped object)."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name', '')}" if ns else str(meta.get("name", ""))


def _version(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _same(a: dict, b: dict) -> bool:
    """One version of one object: the same resourceVersion (objects without one: equal)."""
    va, vb = _version(a), _version(b)
    return va == vb if va and vb else a == b


class WatchCache:
    """The objects by ``key_of``; ``resource_version`` is where a WATCH resumes; ``version``
    counts the changes of the objects (not BOOKMARKs), so a reader can tell whether to rebuild."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.resource_version = ""
        self.version = 0

    def items(self) -> list[dict]:
        return list(self.objects.values())

    def replace(self, items: Iterable[dict], resource_version: str) -> bool:
        """A LIST's answer replaces everything; True when any object was added, changed or removed."""
        fresh = {key_of(o): o for o in items}
        changed = fresh.keys() != self.objects.keys() or any(not _same(o, self.objects[k]) for k, o in fresh.items())
        self.objects = fresh
        self.resource_version = resource_version
        return self._changed(changed)

    def clear(self) -> bool:
        """The kind is not served (its CRD is not installed): there are none."""
        return self.replace([], "")

    def apply(self, event: dict) -> Applied:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            return Applied(Step.RELIST if code == GONE else Step.RECONNECT, False,
                           code if isinstance(code, int) else None)
        rv = _version(obj)
        if rv:
            self.resource_version = rv
        if kind in ("ADDED", "MODIFIED"):
            key = key_of(obj)
            old = self.objects.get(key)
            self.objects[key] = obj
            changed = old is None or not _same(old, obj)
        elif kind == "DELETED":
            changed = self.objects.pop(key_of(obj), None) is not None
        else:   # BOOKMARK (its version is all it carries), or a type this client does not know
            changed = False
        return Applied(Step.CONTINUE, self._changed(changed))

    def _changed(self, changed: bool) -> bool:
        if changed:
            self.version += 1
        return changed


@dataclasses.dataclass(frozen=True)
class Recovery:
    relist: bool   # LIST again; else WATCH again from the cache's resourceVersion
    clear: bool    # the kind is not served: the cache holds nothing
    pause: bool    # wait the backoff first


def recovery(status: int | None, *, listing: bool) -> Recovery:
    """What follows a failed LIST (``listing``) or WATCH answered ``status`` (None: no answer,
    a connection error or a timeout)."""
    if status == GONE:
        return Recovery(relist=True, clear=False, pause=False)
    if status == 404:
        # Not served (a CRD not installed, or removed): no objects, and LIST again later in case it comes.
        return Recovery(relist=True, clear=listing, pause=True)
    if status in (401, 403):
        # Not permitted: a WATCH may never be; LISTing again at the backoff's pace keeps the cache
        # fresh enough to route by while someone grants the verb.
        return Recovery(relist=True, clear=False, pause=True)
    return Recovery(relist=listing, clear=False, pause=True)
