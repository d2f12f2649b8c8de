"""Fleet control loops that run beside reconciliation (autoscaler, audits)."""
from __future__ import annotations


def register_loops(runtime) -> None:
    """Attach the fleet loops to the operator runtime (started with it)."""
    return None
