"""Whose an existing object of a child's name is: the operator applies (with force) only over its own.

A child's name is derived from the service's (the Service is ``<service>``, the ConfigMap
``<service>-guard``, ...), so an object someone else made may already carry it. Server-side apply with
force would take it over: the operator would rewrite a team's Service or ConfigMap because an
InferenceService happens to share its name, with rights the team that created the service may not
have. Instead nothing of the service is applied while any of its children's names is held by another
object: the service reports ``ChildConflict`` (naming the object, who holds it, and the fix), and the
operator looks again until the name is free.

All or nothing, not "the rest where safe": every child depends on the others being the service's.
Deployments mount the ConfigMap (guard.json) and the claims, so pods beside a foreign ConfigMap or
claim would read another's configuration or volume; without its NetworkPolicy an engine is reachable
from anywhere; with a foreign Service the address in status answers with something else.

An object is the service's own when its owner references name the service's uid, or name an
InferenceService of the same name (a former one of that name, deleted and being collected: adopted,
as the garbage collector would otherwise remove it under the new service), or when it has no
controller and carries the labels the operator gives a child of this service (an object orphaned by
``kubectl delete --cascade=orphan``: adopted, as it always was). Labels alone give nothing away:
whoever can set them on an object can also delete it.

Pure: the children's I/O reads the objects, this decides.
"""
from __future__ import annotations

import dataclasses

from gpufleet_api import v1alpha1 as t

from ..manifests import names
from . import conditions as c

CHILD_CONFLICT = "ChildConflict"
NO_CONFLICT = "NoConflict"


@dataclasses.dataclass(frozen=True)
class Foreign:
    """An object holding a child's name that is not the service's: ``holder`` says who holds it."""
    kind: str
    name: str
    holder: str


def _controller(meta: dict) -> dict | None:
    return next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)


def _is_inference_service(ref: dict) -> bool:
    return ref.get("kind") == t.KIND and (ref.get("apiVersion") or "").split("/")[0] == t.GROUP


def owned_by(obj: dict) -> str | None:
    """The uid of the InferenceService that controls ``obj`` (None: none does)."""
    ref = _controller(obj.get("metadata") or {})
    return ref.get("uid") if ref is not None and _is_inference_service(ref) else None


def holder(isvc: dict, existing: dict) -> str | None:
    """None: ``existing`` (an object of a child's kind and name) is ``isvc``'s to apply over; otherwise
    who holds it, in words for a message."""
    service, uid = isvc["metadata"]["name"], isvc["metadata"].get("uid")
    meta = existing.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    if any(ref.get("uid") == uid for ref in refs):
        return None
    controller = _controller(meta)
    if controller is not None:
        if _is_inference_service(controller) and controller.get("name") == service:
            return None
        return f"controlled by {controller.get('kind')} {controller.get('name')}"
    labels = meta.get("labels") or {}
    if labels.get(names.LABEL_MANAGED_BY) == names.MANAGER and labels.get(names.LABEL_SERVICE) == service:
        return None
    others = [f"{ref.get('kind')} {ref.get('name')}" for ref in refs]
    if others:
        return f"owned by {', '.join(others)}"
    managers = sorted({m["manager"] for m in meta.get("managedFields") or [] if m.get("manager")})
    if managers:
        return f"no owner; written by {', '.join(managers)}"
    return "no owner"


def conflict_message(isvc: dict, foreign: list[Foreign]) -> str:
    service = isvc["metadata"]["name"]
    held = "; ".join(f"{f.kind} {f.name} ({f.holder})" for f in foreign)
    them = "that object" if len(foreign) == 1 else "those objects"
    return (f"{held} already exists and is not this InferenceService's: nothing of {service} is applied "
            f"while it does. Delete or rename {them}, or rename the InferenceService")


def conflict_conditions(isvc: dict, foreign: list[Foreign], generation: int) -> list[dict]:
    """ChildConflict True, and Ready and Progressing False saying the same."""
    message = conflict_message(isvc, foreign)
    return [
        c.condition(CHILD_CONFLICT, True, CHILD_CONFLICT, message, generation=generation),
        c.condition(c.READY, False, CHILD_CONFLICT, message, generation=generation),
        c.condition(c.PROGRESSING, False, CHILD_CONFLICT,
                    "nothing is rolled out until every child's name is free or the service's own",
                    generation=generation),
    ]


def cleared(current: dict, generation: int) -> list[dict]:
    """ChildConflict False once every child is the service's again ([] when it never was True)."""
    old = c.get(current.get("conditions"), CHILD_CONFLICT)
    if not old or old.get("status") != "True":
        return []
    return [c.condition(CHILD_CONFLICT, False, NO_CONFLICT, "every child's name is this service's own",
                        generation=generation)]
