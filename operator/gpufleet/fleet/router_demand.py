"""Requests the routers hold for services with no ready replica (scale from zero).

Every second, each router pod's /metrics is read for
``gpufleet_router_held_requests{namespace, service}``; the router pods are
listed every ``list_interval`` seconds by their label. The sums per service
land in the fleet loop's ``demand``, which the service loops pass to the
policy: a service at zero with a request held goes to one replica at its next
tick (docs/router.md). Read-only for the routers: they need no write access to
InferenceServices to wake one up."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_kit.http_limits import METRICS_REPLY_CAP, ReplyTooLarge, text_capped

from .ports import Leadership, ObjectLister

log = logging.getLogger(__name__)

ROUTER_SELECTOR = "app.kubernetes.io/name=gpufleet-router"
HELD = "gpufleet_router_held_requests"
DEFAULT_PORT = 8000


def parse_held(text: str) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == HELD and s.value > 0:
                key = (s.labels.get("namespace", ""), s.labels.get("service", ""))
                out[key] = out.get(key, 0) + int(s.value)
    return out


def router_address(pod: dict) -> str | None:
    """host:port of a running router pod's API port (named http), None when it has no IP yet."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or pod["metadata"].get("deletionTimestamp"):
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return f"{ip}:{port['containerPort']}"
    return f"{ip}:{DEFAULT_PORT}"


Held = dict[tuple[str, str], int]


class RouterDemand:
    def __init__(self, *, pods: ObjectLister | None, publish: Callable[[Held], None],
                 leadership: Leadership | None = None, interval: float = 1.0, list_interval: float = 10.0,
                 addresses: Sequence[str] | None = None):
        """``pods``: where the router pods are listed; ``addresses``: a fixed router host:port list
        instead (tests, a router outside the cluster). ``publish``: takes each reading (the fleet
        loop's ``set_demand``). ``leadership``: only the leader reads (None: always)."""
        self.pods = pods
        self.publish = publish
        self.leadership = leadership
        self.interval = interval
        self.list_interval = list_interval
        self.fixed = None if addresses is None else list(addresses)
        self.addresses: list[str] = list(addresses or [])
        self._listed_at = float("-inf")
        self._timeout = aiohttp.ClientTimeout(total=min(1.0, interval))
        self._session: aiohttp.ClientSession | None = None

    async def read_once(self) -> Held:
        if self.fixed is None and self.pods is not None and time.monotonic() - self._listed_at >= self.list_interval:
            try:
                pods = await self.pods.list("v1", "Pod", None, label_selector=ROUTER_SELECTOR)
                self.addresses = [a for p in pods if (a := router_address(p))]
                self._listed_at = time.monotonic()
            except Exception as e:  # keep the last list; say why it is not refreshed
                log.warning("cannot list router pods: %s", e)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        session = self._session

        async def read(address: str) -> Held:
            try:
                async with session.get(f"http://{address}/metrics") as r:
                    if r.status != 200:
                        return {}
                    return parse_held(await text_capped(r, METRICS_REPLY_CAP, f"router {address} /metrics"))
            except ReplyTooLarge as e:  # unreadable, and worth saying: a router's /metrics is never this large
                log.warning("cannot read router %s: %s", address, e)
                return {}
            except Exception as e:  # a router that does not answer holds nothing we can see
                log.debug("cannot read router %s: %s", address, e)
                return {}
        total: Held = {}
        for held in await asyncio.gather(*(read(a) for a in self.addresses)):
            for key, n in held.items():
                total[key] = total.get(key, 0) + n
        return total

    async def run_forever(self) -> None:
        try:
            while True:
                if self.leadership is None or self.leadership.acting():
                    self.publish(await self.read_once())
                await asyncio.sleep(self.interval)
        finally:
            if self._session is not None:
                await self._session.close()
