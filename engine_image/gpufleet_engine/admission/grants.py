"""What admission hands out and what it refuses with: a ``Grant`` (a dispatch slot plus a KV
reservation) and a ``Rejection`` (the refusal, its metrics reason and HTTP status)."""
from __future__ import annotations

from dataclasses import dataclass

from gpufleet_api.guard.guard_config import QueueClass
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_engine.errors import GuardError


class Rejection(GuardError):
    """The guard refuses a request; ``reason`` is the metrics label, ``status`` the HTTP status."""

    def __init__(self, reason: str, status: int, message: str, retry_after: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.param = param  # the request field at fault, for 4xx


@dataclass(eq=False)
class Grant:
    """A dispatch slot plus a KV reservation; give it back with ``Scheduler.release``."""
    cost: int
    queue_class: QueueClass
    queued_seconds: float
    dispatched_at: float = 0.0
    running_at_dispatch: int = 1   # requests in vLLM once this one was dispatched, itself included
    start_tokens: int = 0          # a streamed request's prompt tokens until its first token comes back
    start_set_tokens: int = 0      # prompt tokens starting once it was dispatched, its own included
    tenant: str = UNKNOWN_TENANT   # the key its service is charged to in its class's fair lane
