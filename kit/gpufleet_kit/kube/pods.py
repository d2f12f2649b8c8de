"""What a pod's status says about serving traffic (as kube-proxy would judge it)."""
from __future__ import annotations


def is_ready(status: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def is_serving(pod: dict) -> bool:
    """Ready, addressed and not terminating: an endpoint that takes new requests."""
    status = pod.get("status") or {}
    return is_ready(status) and bool(status.get("podIP")) and not pod["metadata"].get("deletionTimestamp")
