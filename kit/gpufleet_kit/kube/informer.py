"""An informer: one kind's objects kept current by LIST, then WATCH from the list's version.

The I/O around ``watch_cache`` (which decides what each answer means):

- LIST (optionally by label selector, in one namespace or all), then WATCH
  from the list's resourceVersion with bookmarks, applying each event to the
  cache; when the server ends a watch (``timeoutSeconds``) it is opened
  again from the last version seen, without a LIST.
- 410 Gone (the version is older than the server keeps), as the watch's
  answer or as an ERROR event: LIST again.
- A failed connection or another error: try again after a pause that doubles
  up to 30 s, from the last version (a failed LIST: LIST again). Refused
  (401/403): LIST again at that pace, saying which verb is missing.
- A kind that is not served (404 on LIST: its CRD is not installed): no
  objects, and LIST again later.

``on_change()`` is called after every change of the objects (not after
bookmarks or re-lists that find nothing new); ``cache.version`` counts them.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncGenerator, Awaitable, Callable, Protocol

from ..backoff import Backoff
from .errors import ApiError
from .watch_cache import GONE, Step, WatchCache, recovery

log = logging.getLogger(__name__)

# The server ends each watch after this long and the informer opens the next: a connection that died
# without a word (no RST through a broken NAT) is replaced within it.
WATCH_SECONDS = 240


class Watchable(Protocol):
    """What of KubeClient an informer uses."""

    async def list_versioned(self, api_version: str, kind: str, namespace: str | None = None, *,
                             label_selector: str | None = None,
                             field_selector: str | None = None) -> tuple[list[dict], str]: ...

    def watch(self, api_version: str, kind: str, namespace: str | None = None, *, timeout_seconds: int = 60,
              label_selector: str | None = None, field_selector: str | None = None,
              resource_version: str | None = None, allow_bookmarks: bool = False) -> AsyncGenerator[dict, None]: ...


class Informer:
    def __init__(self, kube: Watchable, api_version: str, kind: str, namespace: str | None = None, *,
                 label_selector: str | None = None, on_change: Callable[[], None] | None = None,
                 watch_seconds: int = WATCH_SECONDS, backoff: Backoff | None = None,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep, refused_hint: str = ""):
        self.kube = kube
        self.api_version, self.kind, self.namespace = api_version, kind, namespace
        self.label_selector = label_selector
        self.on_change = on_change
        self.watch_seconds = watch_seconds
        # ±20% so that routers cut off together do not come back together.
        self.backoff = backoff or Backoff(first=0.5, cap=30.0, jitter=0.2)
        self._sleep = sleep
        self.refused_hint = refused_hint     # what to do when a verb is refused, for the log
        self.cache = WatchCache()
        self.synced = asyncio.Event()        # a LIST answered (a kind not served counts: none of it)
        self.tried = asyncio.Event()         # the first LIST answered or failed

    def __str__(self) -> str:
        where = f"in {self.namespace}" if self.namespace else "in every namespace"
        chosen = f" ({self.label_selector})" if self.label_selector else ""
        return f"{self.kind}{chosen} {where}"

    def items(self) -> list[dict]:
        return self.cache.items()

    async def run(self) -> None:
        """Until cancelled."""
        relist = True
        gone_before = False   # the last failure was a 410 too, with nothing delivered since: pause first
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                if await self._watch():
                    gone_before = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # every failure is retried: an informer that stops leaves its cache stale
                status = e.status if isinstance(e, ApiError) else None
                what = recovery(status, listing=relist)
                self._report(e, status, relist)
                if relist:
                    self.tried.set()
                if what.clear:
                    self._changed(self.cache.clear())
                    self.synced.set()
                pause = what.pause or (status == GONE and gone_before)
                gone_before = status == GONE
                relist = what.relist
                if pause:
                    await self._sleep(self.backoff.next())

    async def _list(self) -> None:
        items, version = await self.kube.list_versioned(self.api_version, self.kind, self.namespace,
                                                        label_selector=self.label_selector)
        self._changed(self.cache.replace(items, version))
        self.synced.set()
        self.tried.set()

    async def _watch(self) -> int:
        """Apply events until the server ends the watch; the number applied. An ERROR event is raised
        as the ApiError it reports (410: LIST again)."""
        delivered = 0
        stream = self.kube.watch(self.api_version, self.kind, self.namespace, timeout_seconds=self.watch_seconds,
                                 label_selector=self.label_selector,
                                 resource_version=self.cache.resource_version or None, allow_bookmarks=True)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                applied = self.cache.apply(event)
                if applied.step is not Step.CONTINUE:
                    status = event.get("object") or {}
                    raise ApiError(applied.status or 500, str(status.get("reason") or "Error"),
                                   str(status.get("message") or "the watch ended in an ERROR event"), status)
                self._changed(applied.changed)
                delivered += 1
                self.backoff.reset()   # a watch that delivers is a healthy one
        return delivered

    def _changed(self, changed: bool) -> bool:
        if changed and self.on_change is not None:
            self.on_change()
        return changed

    def _report(self, e: Exception, status: int | None, listing: bool) -> None:
        verb = "list" if listing else "watch"
        if status == GONE:
            log.debug("%s: %s answered 410 Gone; listing again", self, verb)
        elif status in (401, 403):
            hint = f"; {self.refused_hint}" if self.refused_hint else ""
            log.error("%s: not permitted to %s (%s)%s", self, verb, e, hint)
        elif status == 404 and listing:
            log.info("%s: not served (%s); none until it is", self, e)
        else:
            log.warning("%s: %s failed (%s); trying again", self, verb, str(e) or type(e).__name__)
