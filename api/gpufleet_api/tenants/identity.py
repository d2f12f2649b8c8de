"""What identifying a caller gives: its tenant, or the reason it has none and what it is told (HTTP 401).
Neither holds what the caller presented."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Reason = Literal["missing", "malformed", "unknown"]


@dataclass(frozen=True)
class Identified:
    tenant: str


@dataclass(frozen=True)
class Refused:
    reason: Reason
    message: str
