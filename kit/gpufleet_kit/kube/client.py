"""The one async client for the Kubernetes API (aiohttp, no globals).

Connection settings and credentials come from ``config`` (the kubernetes
package's loaders: exec plugins, OIDC, token files, merged kubeconfigs,
in-cluster); expiring tokens are reloaded before they lapse and once more
when the API server answers 401.

Server-side apply with a single field manager is the write path; reads are
plain GET/LIST. Kinds are resolved to URL paths through API discovery, cached
per client. A transport can be injected (``session``) so tests need no socket.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Any, AsyncGenerator, Callable

import aiohttp

from .config import Credentials, KubeConfig
from .errors import ApiError, NotFound, NotLeading, Unreachable, error_for
from .request_kind import request_kind

log = logging.getLogger(__name__)

FIELD_MANAGER = "gpufleet"
Listing = tuple[list[dict], str]   # a LIST's items and its resourceVersion
# One watch event is one JSON line; an object is at most etcd's request limit (1.5 MiB by default).
MAX_WATCH_EVENT_BYTES = 16 << 20


class KubeClient:
    """``config`` says where the API server is and how to log in; its credentials
    are reloaded (off the event loop) when they go stale or are refused."""

    def __init__(self, config: KubeConfig, *, timeout: float = 30.0,
                 session: aiohttp.ClientSession | None = None,
                 write_fence: Callable[[], float] | None = None,
                 on_request: Callable[[str, str, int], None] | None = None, connection_limit: int = 32):
        self.config = config
        # Told (verb, resource, status code) of every request answered: the operator's count of its own
        # round trips (gpufleet_operator_api_requests_total); status 0 when no answer came.
        self.on_request = on_request
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        # Seconds this client may still write for (a leader's remaining lease); writes past it are
        # refused before they are sent, and a write never waits for an answer beyond it.
        self.write_fence = write_fence
        self._session = session
        # Each open WATCH holds a connection for its whole life: a client that watches raises this.
        self._connection_limit = connection_limit
        self._ssl: tuple[tuple, ssl.SSLContext | bool] | None = None  # (tls identity, context)
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}
        self._discovery_lock = asyncio.Lock()
        self._reload_lock = asyncio.Lock()

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._connection_limit),
                                                  timeout=self._timeout)
        return self._session

    def _ssl_context(self, creds: Credentials) -> ssl.SSLContext | bool:
        # Per request, so a plugin that hands out a new client certificate gets new connections
        # (the pool keys connections by context) while streams on the old ones finish.
        if self._ssl is None or self._ssl[0] != creds.tls_identity:
            self._ssl = (creds.tls_identity, creds.ssl_context())
        return self._ssl[1]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # --- credentials ---------------------------------------------------------------

    async def credentials(self) -> Credentials:
        """The current credentials, reloaded first when they are stale (an expiring token)."""
        creds = self.config.current
        if creds.stale():
            async with self._reload_lock:
                creds = await asyncio.to_thread(self.config.refresh_if_stale)
        return creds

    async def reload_credentials(self, *, unless_newer_than: int | None = None) -> Credentials:
        """Load the credentials again now (after a 401 elsewhere, e.g. kopf's own client)."""
        async with self._reload_lock:
            return await asyncio.to_thread(self.config.reload, unless_newer_than=unless_newer_than)

    async def _after_refusal(self, refused: Credentials) -> Credentials | None:
        async with self._reload_lock:
            fresh = await asyncio.to_thread(self.config.reload_refused, refused)
        if fresh is not None:
            log.info("the API server refused the credentials of %s; reloaded them", self.config.source)
        return fresh

    def _send(self, creds: Credentials, method: str, path: str, headers: dict, **kwargs):
        headers = dict(headers)
        if creds.authorization:
            headers["Authorization"] = creds.authorization
        if creds.tls_server_name:
            kwargs["server_hostname"] = creds.tls_server_name
        if creds.proxy:
            kwargs["proxy"] = creds.proxy
        return self._http().request(method, creds.server + path, headers=headers,
                                    ssl=self._ssl_context(creds), **kwargs)

    async def request(self, method: str, path: str, *, params: dict | None = None,
                      body: Any = None, content_type: str = "application/json",
                      timeout: float | None = None, accept: str = "application/json") -> dict:
        """``accept``: what the answer may be; a route that produces another JSON type (the issuer's
        key set, ``application/jwk-set+json``) answers 406 to plain JSON."""
        headers = {"Accept": accept}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        ceil = 5.0  # aiohttp's default: longer timeouts are rounded up to whole seconds
        fence = self.write_fence if method != "GET" else None
        creds = await self.credentials()
        if fence is not None:
            # Asked after the credentials' await, right before sending: under load that await can
            # outlast the lease, and a write must not leave after this replica stopped leading.
            remaining = fence()
            if remaining <= 0:
                raise NotLeading(f"{method} {path}")
            timeout, ceil = min(timeout or self._timeout.total or remaining, remaining), float("inf")
        kwargs = {}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, ceil_threshold=ceil)
        for attempt in range(2):
            try:
                async with self._send(creds, method, path, headers, params=params, data=data, **kwargs) as resp:
                    text = await resp.text()
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._counted(method, path, params, 0)
                raise Unreachable(f"{method} {path}: {type(e).__name__}: {e}") from e
            self._counted(method, path, params, status)
            if status == 401 and attempt == 0 and (fresh := await self._after_refusal(creds)) is not None:
                creds = fresh  # once: reloaded credentials that are refused too are reported
                continue
            break
        try:
            payload = json.loads(text) if text else {}
        except ValueError:
            payload = {}
        if status >= 400:
            raise error_for(status, payload if isinstance(payload, dict) else {}, text)
        return payload

    def _counted(self, method: str, path: str, params: dict | None, status: int) -> None:
        if self.on_request is not None:
            verb, resource = request_kind(method, path, params)
            self.on_request(verb, resource, status)

    # --- discovery -----------------------------------------------------------------

    async def resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(plural, namespaced) for a kind, via discovery."""
        key = (api_version, kind)
        if key not in self._resources:
            async with self._discovery_lock:
                if key not in self._resources:
                    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
                    try:
                        doc = await self.request("GET", base)
                    except NotFound:
                        raise NotFound(404, "NotFound", f"API {api_version} is not served") from None
                    for r in doc.get("resources", []):
                        if "/" not in r["name"]:
                            self._resources[(api_version, r["kind"])] = (r["name"], r["namespaced"])
                    if key not in self._resources:
                        raise NotFound(404, "NotFound", f"kind {kind} is not served by {api_version}")
        return self._resources[key]

    def forget_discovery(self) -> None:
        self._resources.clear()

    async def path(self, api_version: str, kind: str, namespace: str | None = None,
                   name: str | None = None, subresource: str | None = None) -> str:
        plural, namespaced = await self.resource(api_version, kind)
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        parts = [base]
        if namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)

    async def has_kind(self, api_version: str, kind: str) -> bool:
        try:
            await self.resource(api_version, kind)
            return True
        except NotFound:
            return False

    # --- verbs ---------------------------------------------------------------------

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None,
                  subresource: str | None = None) -> dict:
        return await self.request("GET", await self.path(api_version, kind, namespace, name, subresource))

    async def get_or_none(self, api_version: str, kind: str, name: str,
                          namespace: str | None = None) -> dict | None:
        try:
            return await self.get(api_version, kind, name, namespace)
        except NotFound:
            return None

    async def list(self, api_version: str, kind: str, namespace: str | None = None, *,
                   label_selector: str | None = None, field_selector: str | None = None) -> list[dict]:
        items, _ = await self.list_versioned(api_version, kind, namespace, label_selector=label_selector,
                                             field_selector=field_selector)
        return items

    async def list_versioned(self, api_version: str, kind: str, namespace: str | None = None, *,
                             label_selector: str | None = None,
                             field_selector: str | None = None) -> Listing:
        """The items and the list's resourceVersion: where a WATCH of the same objects resumes."""
        params = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        doc = await self.request("GET", await self.path(api_version, kind, namespace), params=params)
        items = doc.get("items", [])
        for item in items:  # LIST strips these; put them back so items are self-describing
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items, str((doc.get("metadata") or {}).get("resourceVersion") or "")

    async def apply(self, obj: dict, *, field_manager: str = FIELD_MANAGER, force: bool = True,
                    subresource: str | None = None) -> dict:
        """Server-side apply: the object as this manager wants it, nothing else."""
        meta = obj["metadata"]
        path = await self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return await self.request("PATCH", path, params=params, body=obj,
                                  content_type="application/apply-patch+yaml")

    async def create(self, obj: dict) -> dict:
        meta = obj["metadata"]
        path = await self.path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self.request("POST", path, body=obj)

    async def merge_patch(self, api_version: str, kind: str, name: str, patch: dict,
                          namespace: str | None = None, subresource: str | None = None) -> dict:
        path = await self.path(api_version, kind, namespace, name, subresource)
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None, *,
                     propagation: str = "Background", grace_period_seconds: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        body: dict = {"propagationPolicy": propagation}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        try:
            await self.request("DELETE", await self.path(api_version, kind, namespace, name), body=body)
            return True
        except NotFound:
            return False

    async def watch(self, api_version: str, kind: str, namespace: str | None = None, *,
                    timeout_seconds: int = 60, label_selector: str | None = None,
                    field_selector: str | None = None, resource_version: str | None = None,
                    allow_bookmarks: bool = False) -> AsyncGenerator[dict, None]:
        """The watch events (``{"type", "object"}``) until the server ends the watch after
        ``timeout_seconds``. From ``resource_version`` (a LIST's), or, without one, every object as
        ADDED first; ``allow_bookmarks``: BOOKMARK events carry newer versions to resume from.
        A version the server no longer keeps is answered 410 (ApiError), or as an ERROR event."""
        params = {"watch": "true", "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        if resource_version:
            params["resourceVersion"] = resource_version
        if allow_bookmarks:
            params["allowWatchBookmarks"] = "true"
        path = await self.path(api_version, kind, namespace)
        creds = await self.credentials()
        timeout = aiohttp.ClientTimeout(total=timeout_seconds + 10)
        for attempt in range(2):
            answered = False
            try:
                async with self._send(creds, "GET", path, {}, params=params, timeout=timeout) as resp:
                    answered = True
                    self._counted("GET", path, params, resp.status)
                    if resp.status == 401 and attempt == 0 and (fresh := await self._after_refusal(creds)) is not None:
                        creds = fresh
                        continue
                    if resp.status >= 400:
                        text = await resp.text()
                        try:
                            body = json.loads(text)
                        except ValueError:
                            body = None
                        raise error_for(resp.status, body if isinstance(body, dict) else None, text)
                    while line := await resp.content.readuntil(b"\n", max_size=MAX_WATCH_EVENT_BYTES):
                        if line.strip():
                            yield json.loads(line)
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if not answered:
                    self._counted("GET", path, params, 0)
                raise Unreachable(f"WATCH {path}: {type(e).__name__}: {e}") from e

    async def event(self, involved: dict, *, reason: str, message: str, type_: str = "Normal",
                    component: str = "gpufleet-operator") -> None:
        """Record a core/v1 Event about an object (best effort)."""
        from datetime import datetime, timezone
        meta = involved["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ns = meta.get("namespace") or "default"
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": ns},
            "involvedObject": {"apiVersion": involved["apiVersion"], "kind": involved["kind"],
                               "name": meta["name"], "namespace": ns, "uid": meta.get("uid")},
            "reason": reason, "message": message[:1000], "type": type_,
            "source": {"component": component},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": component, "reportingInstance": component,
        }
        try:
            await self.request("POST", f"/api/v1/namespaces/{ns}/events", body=ev)
        except ApiError as e:
            log.warning("could not record event %s on %s: %s", reason, meta["name"], e)
