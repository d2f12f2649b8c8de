"""What an API request is, in the API server's own terms (pure): its verb (get, list, watch,
create, patch, update, delete) and its resource (``pods``, ``inferenceservices/status``), so the
operator can count its round trips the way ``apiserver_request_total`` does."""
from __future__ import annotations

_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def request_kind(method: str, path: str, params: dict | None = None) -> tuple[str, str]:
    """(verb, resource) of ``method path``; resource "" for discovery and other non-resource paths."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]          # /api/v1/...
    elif parts[:1] == ["apis"]:
        rest = parts[3:]          # /apis/group/version/...
    else:
        rest = []
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]           # namespaces/<ns>/<plural>/...
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        if (params or {}).get("watch") in ("true", "1", True):
            verb = "watch"
        else:
            verb = "get" if named or not resource else "list"
    else:
        verb = _VERBS.get(method, method.lower())
    return verb, resource
