"""The guard's exception root. The guard's own errors derive from ``GuardError``; at its boundary
(serving/) each becomes an OpenAI-shaped refusal with a code from the API's guard_metrics.Reason, and
aiohttp's errors from vLLM become ``EngineDown`` before they go further."""
from __future__ import annotations


class GuardError(Exception):
    """An error the guard raises on purpose."""
