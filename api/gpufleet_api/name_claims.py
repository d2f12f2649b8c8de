"""Who owns a model name clients send: the one rule the router routes by and the operator reports (pure).

A request's ``model`` is a base model (an InferenceService's served name: ``spec.model.servedName``, else
``spec.model.name``) or a LoRA adapter (an InferenceAdapter's ``metadata.name``). Every such name is
claimed by the objects that serve it, in any namespace, and owned by one of them:

- the namespace of the oldest claim (``metadata.creationTimestamp``, then namespace, then name) owns the
  name: a claim in any other namespace loses, whether a base model or an adapter claims it, so a second
  namespace never receives the first's requests nor their Authorization headers;
- inside the owning namespace, a base model keeps the name over an adapter, and of two claims of one kind
  the older keeps it (one team's own objects; the router did so before names were owned by namespaces).

An object being deleted claims nothing (deleting the owner frees the name for the next oldest claim). An
InferenceService whose spec does not parse still claims the name its ``spec.model`` gives: it serves
nothing meanwhile, and no other namespace takes its clients' requests while it is fixed.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from . import SpecError, parse, parse_spec
from .route import served_name
from .v1alpha1 import ADAPTER_KIND, KIND, ModelSpec

SERVICE = KIND            # "InferenceService"
ADAPTER = ADAPTER_KIND    # "InferenceAdapter"
CONDITION = "NameConflict"   # the losing object's condition type, and its Event's reason
REASON = "NameClaimedElsewhere"   # the condition's reason while it is True
REASON_CLEARED = "NameOwned"      # ... and once the conflict has gone

Key = tuple[str, str, str]   # (kind, namespace, name)


@dataclasses.dataclass(frozen=True)
class Claim:
    """One object serving a name."""
    kind: str          # SERVICE or ADAPTER
    namespace: str
    name: str
    served: str        # the name clients send as ``model``
    created: str = ""  # metadata.creationTimestamp (RFC 3339, so strings sort by time)

    @property
    def key(self) -> Key:
        return (self.kind, self.namespace, self.name)

    @property
    def age(self) -> tuple[str, str, str, int]:
        """Older first; a base model before an adapter created the same second with the same name."""
        return (self.created, self.namespace, self.name, 0 if self.kind == SERVICE else 1)

    @property
    def fix(self) -> str:
        """What the owner of a losing claim changes."""
        if self.kind == SERVICE:
            return "give this InferenceService another spec.model.servedName"
        return ("rename this InferenceAdapter (its metadata.name is the model name clients send: create it "
                "again under another name)")


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A claim that lost its name to ``owner``."""
    claim: Claim
    owner: Claim

    @property
    def message(self) -> str:
        what = "the adapter" if self.owner.kind == ADAPTER else "model"
        return (f"{self.owner.namespace}/{self.owner.name} already serves {what} {self.claim.served!r}; "
                f"{self.claim.fix}")


@dataclasses.dataclass(frozen=True)
class Decision:
    owners: Mapping[str, Claim]        # served name -> the claim that owns it
    conflicts: Mapping[Key, Conflict]  # the claims that lost theirs

    def conflict(self, kind: str, namespace: str, name: str) -> Conflict | None:
        return self.conflicts.get((kind, namespace, name))

    def owns(self, claim: Claim) -> bool:
        return self.owners.get(claim.served) == claim


EMPTY = Decision({}, {})


def decide(claims: Iterable[Claim]) -> Decision:
    """The owner of every name claimed, and each losing claim with the owner it lost to."""
    by_name: dict[str, list[Claim]] = {}
    for c in claims:
        by_name.setdefault(c.served, []).append(c)
    owners: dict[str, Claim] = {}
    conflicts: dict[Key, Conflict] = {}
    for served, group in by_name.items():
        owner = owner_of(group)
        owners[served] = owner
        for c in group:
            if c.key != owner.key:
                conflicts[c.key] = Conflict(c, owner)
    return Decision(owners, conflicts)


def owner_of(group: list[Claim]) -> Claim:
    """Of the claims of one name: the oldest claim's namespace owns it; there a base model before an adapter,
    the older first."""
    ordered = sorted(group, key=lambda c: c.age)
    home = ordered[0].namespace
    return min((c for c in ordered if c.namespace == home), key=lambda c: (c.kind != SERVICE, c.age))


def service_claim(isvc: dict) -> Claim | None:
    """The name an InferenceService claims; None while it is deleted or has no readable spec.model."""
    meta = isvc.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    spec = isvc.get("spec")
    try:
        served = served_name(parse_spec(spec))
    except SpecError:
        # Another field is wrong: the name stays this service's while its owner fixes it.
        try:
            model = parse(ModelSpec, (spec or {}).get("model") if isinstance(spec, dict) else None, "spec.model")
        except SpecError:
            return None
        served = model.served_name or model.name
    return Claim(SERVICE, meta.get("namespace", ""), meta.get("name", ""), served, meta.get("creationTimestamp") or "")


def adapter_claim(adapter: dict) -> Claim | None:
    """The name an InferenceAdapter claims (its metadata.name); None while it is deleted."""
    meta = adapter.get("metadata") or {}
    if meta.get("deletionTimestamp") or not meta.get("name"):
        return None
    return Claim(ADAPTER, meta.get("namespace", ""), meta["name"], meta["name"], meta.get("creationTimestamp") or "")


def decide_objects(services: Iterable[dict], adapters: Iterable[dict] = ()) -> Decision:
    """``decide`` over InferenceService and InferenceAdapter objects as the API server lists them."""
    claims = [service_claim(s) for s in services] + [adapter_claim(a) for a in adapters]
    return decide(c for c in claims if c is not None)
