"""Which watch events of a service's children need its children applied again.

Every apply the operator makes comes back to it as a watch event of the child, and a Deployment's
status moves several times while its pods start. Re-applying every child for each of them (what a
child event did before) multiplied the API writes of a reconcile by the events it caused: at 1000
services most of the operator's requests were the echoes of its own writes. What the operator last
stored for each child (its resourceVersion and generation, from the apply's answer) tells them apart:

- the operator's own write coming back (the resourceVersion it stored): nothing to do;
- a status move (same generation: a Deployment's rollout, a budget's counts): the owner's status is
  refreshed, nothing applied;
- a deletion, a spec someone else changed (a new generation), a change of a kind without a generation
  (ConfigMap, Service) it did not make, or a child it has not stored (after a restart): applied again.

The same records say which InferenceService controls each child the operator has stored or seen
(``owner``): a child known to be the service's own is applied without being read first
(``reconcile.ownership``).

Pure: the controller records its applies, the child-event handler asks.
"""
from __future__ import annotations

import enum

from .ownership import owned_by

Key = tuple[str, str, str]   # kind, namespace, name


class Action(enum.Enum):
    NOTHING = "nothing"
    STATUS = "status"   # refresh the owner's status
    APPLY = "apply"     # apply the owner's children again


def _key(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


class AppliedChildren:
    """resourceVersion and generation of what the operator last stored, per child."""

    def __init__(self) -> None:
        self._stored: dict[Key, tuple[str | None, int | None]] = {}
        self._owners: dict[Key, str] = {}   # the uid of the InferenceService controlling each child seen

    def _seen(self, key: Key, body: dict) -> None:
        uid = owned_by(body)
        if uid is None:
            self._owners.pop(key, None)
        else:
            self._owners[key] = uid

    def owner(self, kind: str, namespace: str, name: str) -> str | None:
        """The uid of the InferenceService that controlled the child when it was last stored or seen
        (None: not known, or none; a deleted child is forgotten)."""
        return self._owners.get((kind, namespace, name))

    def applied(self, stored: dict) -> dict:
        """Record the apply's answer (the object as stored); returns it."""
        meta = stored.get("metadata") or {}
        self._stored[_key(stored)] = (meta.get("resourceVersion"), meta.get("generation"))
        self._seen(_key(stored), stored)
        return stored

    def event(self, type_: str | None, body: dict) -> Action:
        """What a watch event of a child (``type_``: ADDED, MODIFIED, DELETED, None for a listing) asks for."""
        key = _key(body)
        if type_ == "DELETED":
            self._stored.pop(key, None)
            self._owners.pop(key, None)
            return Action.APPLY
        self._seen(key, body)
        stored = self._stored.get(key)
        if stored is None:
            return Action.APPLY
        version, generation = stored
        meta = body.get("metadata") or {}
        if meta.get("resourceVersion") == version:
            return Action.NOTHING
        if generation is not None and meta.get("generation") == generation:
            return Action.STATUS
        return Action.APPLY

    def __len__(self) -> int:
        return len(self._stored)
