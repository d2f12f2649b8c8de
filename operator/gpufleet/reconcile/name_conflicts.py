"""Which InferenceServices and InferenceAdapters lost the model name they claim, and their NameConflict
condition (pure: memory only).

The rule is the API's (gpufleet_api.name_claims), the one the router routes by: the namespace that claimed a
name first keeps it. The watches feed every InferenceService and InferenceAdapter in (``upsert_service``,
``upsert_adapter``, ``remove``) and each change answers which objects' conflicts it changed, so the runtime
refreshes exactly those; no request to the API server is made for it. Only the names a change touches are
decided again, and an object whose generation has not moved (its status written) is not parsed again.
"""
from __future__ import annotations

from gpufleet_api import name_claims
from gpufleet_api.name_claims import ADAPTER, SERVICE, Claim, Conflict, Key

from . import conditions as cond

NAME_CONFLICT = cond.NAME_CONFLICT


class NameClaimIndex:
    def __init__(self) -> None:
        self._claims: dict[Key, Claim] = {}
        self._by_name: dict[str, set[Key]] = {}
        self._conflicts: dict[Key, Conflict] = {}
        self._seen: dict[Key, tuple[object, bool]] = {}   # key -> (generation, deleting) last parsed

    def conflict(self, kind: str, namespace: str, name: str) -> Conflict | None:
        return self._conflicts.get((kind, namespace, name))

    def upsert_service(self, body: dict) -> set[Key]:
        """An InferenceService as its watch shows it; the keys whose conflict this changed."""
        return self._upsert(SERVICE, body, name_claims.service_claim)

    def upsert_adapter(self, body: dict) -> set[Key]:
        return self._upsert(ADAPTER, body, name_claims.adapter_claim)

    def remove(self, kind: str, namespace: str, name: str) -> set[Key]:
        key = (kind, namespace, name)
        self._seen.pop(key, None)
        return self._set(key, None)

    def _upsert(self, kind: str, body: dict, claim_of) -> set[Key]:
        meta = body.get("metadata") or {}
        key = (kind, meta.get("namespace", ""), meta.get("name", ""))
        seen = (meta.get("generation"), bool(meta.get("deletionTimestamp")))
        if key in self._seen and self._seen[key] == seen and seen[0] is not None:
            return set()
        self._seen[key] = seen
        return self._set(key, claim_of(body))

    def _set(self, key: Key, claim: Claim | None) -> set[Key]:
        old = self._claims.get(key)
        if old == claim:
            return set()
        names = set()
        if old is not None:
            names.add(old.served)
            self._by_name[old.served].discard(key)
            del self._claims[key]
        if claim is not None:
            names.add(claim.served)
            self._claims[key] = claim
            self._by_name.setdefault(claim.served, set()).add(key)
        changed = {key} if key in self._conflicts else set()
        self._conflicts.pop(key, None)
        for served in names:
            keys = self._by_name.get(served) or set()
            if not keys:
                self._by_name.pop(served, None)
                continue
            decision = name_claims.decide(self._claims[k] for k in keys)
            for k in keys:
                new = decision.conflicts.get(k)
                if self._conflicts.get(k) != new:
                    changed.add(k)
                    if new is None:
                        self._conflicts.pop(k, None)
                    else:
                        self._conflicts[k] = new
        return changed


def condition(conflict: Conflict | None, previous: list[dict] | None, generation: int | None = None) -> list[dict]:
    """The NameConflict condition to write: True naming the owner while ``conflict``; False once it has gone
    (only where it was True: an object that never lost its name carries no NameConflict condition)."""
    if conflict is not None:
        return [cond.condition(NAME_CONFLICT, True, name_claims.REASON, conflict.message, generation=generation)]
    old = cond.get(previous, NAME_CONFLICT)
    if old is not None and old.get("status") == "True":
        return [cond.condition(NAME_CONFLICT, False, name_claims.REASON_CLEARED,
                               "this object owns the model name it serves again", generation=generation)]
    return []


def started(previous: list[dict] | None, updates: list[dict]) -> str | None:
    """The message of a NameConflict that starts with ``updates`` (for its one Event); None otherwise."""
    new = cond.get(updates, NAME_CONFLICT)
    old = cond.get(previous, NAME_CONFLICT) or {}
    if new is None or new["status"] != "True":
        return None
    if old.get("status") == "True" and old.get("message") == new["message"]:
        return None
    return new["message"]
