"""The small exception hierarchy for Kubernetes API calls.

Callers branch on these classes, never on raw HTTP codes: transient errors are
retried with backoff, the rest are reported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import KitError


class KubeError(KitError):
    """The kit's Kubernetes errors: the API server's answers and unusable credentials."""


class ApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str, body: dict | None = None):
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def transient(self) -> bool:
        return self.status in (409, 429) or self.status >= 500

    @property
    def namespace_terminating(self) -> bool:
        """403 because the namespace is being deleted: the object is going away with it."""
        causes = (self.body.get("details") or {}).get("causes") or []
        return self.status == 403 and (any(c.get("reason") == "NamespaceTerminating" for c in causes)
                                       or "because it is being terminated" in self.message)


class Unreachable(KubeError):
    """The API server did not answer: the connection failed, broke off or timed out (the transport's own
    error, aiohttp's or the timeout, is the ``__cause__``). Transient: asking again soon may succeed."""

    transient = True


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class Invalid(ApiError):
    """422: the object failed validation (schema, CEL rules, admission)."""


# The API server's RBAC refusal: 'nodes is forbidden: User "u" cannot list resource "nodes" in API group ""
# at the cluster scope' (or '... in the namespace "ns"').
_REFUSAL = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>[\w-]+) resource "(?P<resource>[^"]+)"'
                      r'(?: in API group "(?P<group>[^"]*)")?(?: in the namespace "(?P<namespace>[^"]*)")?')


@dataclass(frozen=True)
class Refusal:
    """What an identity was not permitted to do: ``verb`` on ``resource`` (plural, with its
    API group when it has one), in ``namespace`` or at the cluster scope."""
    verb: str
    resource: str
    namespace: str | None = None
    user: str | None = None

    def __str__(self) -> str:
        where = f" in namespace {self.namespace}" if self.namespace else ""
        who = f" (as {self.user})" if self.user else ""
        return f"not permitted: {self.verb} {self.resource}{where}{who}"


class Forbidden(ApiError):
    def refusal(self, verb: str, resource: str, namespace: str | None = None) -> Refusal:
        """What was refused, from the server's message; ``verb``, ``resource`` and ``namespace``
        (what was asked) where the message does not say."""
        m = _REFUSAL.search(self.message)
        if not m:
            return Refusal(verb, resource, namespace)
        group = m["group"]
        return Refusal(m["verb"], f"{m['resource']}.{group}" if group else m["resource"], m["namespace"],
                       m["user"] or None)


class NotLeading(ApiError):
    """Refused before it was sent: this replica does not hold the leader lease (or holds
    it for too short a time to be sure of it), so it may not write."""

    def __init__(self, request: str):
        super().__init__(0, "NotLeading", f"{request}: this operator replica is not the leader")


def error_for(status: int, body: dict | None, text: str) -> ApiError:
    body = body or {}
    reason = body.get("reason") or str(status)
    message = body.get("message") or text[:500]
    cls = {404: NotFound, 409: Conflict, 422: Invalid, 403: Forbidden}.get(status, ApiError)
    return cls(status, reason, message, body)
