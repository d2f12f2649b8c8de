"""The small exception hierarchy for Kubernetes API calls.

Callers branch on these classes, never on raw HTTP codes: transient errors are
retried with backoff, the rest are reported.
"""
from __future__ import annotations


class ApiError(Exception):
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


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class Invalid(ApiError):
    """422: the object failed validation (schema, CEL rules, admission)."""


class Forbidden(ApiError):
    pass


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
