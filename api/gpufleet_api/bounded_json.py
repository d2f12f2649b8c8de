"""JSON from a client or a tenant, parsed with its nesting bounded.

Python's ``json.loads`` recurses once per level of arrays and objects: a body of 100,000 ``[``
raises RecursionError, past every handler that catches ValueError (a 500 and a traceback), and
code that walks a parsed document hundreds of levels deep recurses as deep. ``loads`` refuses a
document nested deeper than ``MAX_DEPTH`` levels with ``TooDeep`` (a ValueError) naming the problem
and the fix. It costs nearly nothing: a document with at most ``MAX_DEPTH`` brackets in all (most
requests) cannot be deeper and is not walked; another is walked once, without recursion, over its
arrays and objects only (json.loads itself stops at Python's recursion limit, and that
RecursionError is turned into TooDeep).
"""
from __future__ import annotations

import json
from typing import Any

from .errors import ContractError

MAX_DEPTH = 64
_CONTAINERS = (dict, list)


class TooDeep(ContractError, ValueError):
    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"JSON nested deeper than {limit} levels: send a document with at most {limit} "
                         f"levels of arrays and objects")


def depth(doc: Any, cap: int | None = None) -> int:
    """The deepest nesting of arrays and objects in the parsed ``doc`` (a scalar: 0), one level at a
    time; with ``cap``, the walk stops at the first level past ``cap``."""
    level = [doc] if isinstance(doc, _CONTAINERS) else []
    deepest = 0
    while level:
        deepest += 1
        if cap is not None and deepest > cap:
            break
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, _CONTAINERS)]
    return deepest


def _openings(raw: bytes | str) -> int:
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")


def loads(raw: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(raw)``, refusing a document nested deeper than ``max_depth`` (TooDeep). Every
    failure is a ValueError: json.JSONDecodeError, a UnicodeDecodeError, or TooDeep."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise TooDeep(max_depth) from None
    if _openings(raw) > max_depth and depth(doc, max_depth) > max_depth:
        raise TooDeep(max_depth)
    return doc
