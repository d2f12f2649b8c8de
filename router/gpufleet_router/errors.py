"""The router's exception root. The router's own errors derive from ``RouterError``; at its boundary
(server.py, forwarding.py) each becomes an OpenAI-shaped answer to the client or a counted outcome, and
aiohttp's client errors from a replica become ``Unreachable`` (exchange.py) before they go further."""
from __future__ import annotations


class RouterError(Exception):
    """An error the router raises on purpose."""
