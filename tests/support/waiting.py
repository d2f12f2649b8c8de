"""Wait for a condition with a timeout and a failure message that shows the
last observed state (no bare sleeps in tests)."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Awaitable, Callable

# Pods of a new or scaled Deployment Running on simulated (kwok) nodes, through the
# Deployment and ReplicaSet controllers and kube-scheduler: seconds on a quiet machine,
# past a minute on a loaded CI one.
PODS_START_SECONDS = 120


class WaitTimeout(AssertionError):
    pass


async def wait_for(check: Callable[[], Any | Awaitable[Any]], *, timeout: float, what: str,
                   interval: float = 0.25, describe: Callable[[], Any | Awaitable[Any]] | None = None) -> Any:
    """Poll ``check`` until it returns a truthy value (returned). On timeout,
    fail with ``what`` and the last value or exception, plus ``describe()``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            last = value
        except AssertionError:
            raise
        except Exception as e:  # still converging; keep the reason for the failure message
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            extra = ""
            if describe is not None:
                try:
                    d = describe()
                    if inspect.isawaitable(d):
                        d = await d
                    extra = f"\nstate: {d}"
                except Exception as e:
                    extra = f"\n(describe failed: {e})"
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}{extra}")
        await asyncio.sleep(interval)
