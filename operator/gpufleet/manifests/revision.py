"""The revision of what a replica serves: a hash of its pod template (``names.LABEL_REVISION``).

The template the reconciler builds for the stable Deployment, without the revision label itself,
is hashed: a change of model, engine image, engine arguments or any restart field of guard.json
(the template's config-hash annotation) makes a new revision; an admission-only change (live
fields of guard.json, in the ConfigMap only) does not.
"""
from __future__ import annotations

import hashlib
import json

from . import names

LENGTH = 10


def of_template(template: dict) -> str:
    """The revision of a pod template (its own revision label left out). ``template`` is not copied
    (only the labels are, when they hold the label): it is rendered on every apply."""
    clean, meta = template, template.get("metadata") or {}
    labels = meta.get("labels") or {}
    if names.LABEL_REVISION in labels:
        clean = {**template, "metadata": {**meta, "labels": {
            k: v for k, v in labels.items() if k != names.LABEL_REVISION}}}
    rendered = json.dumps(clean, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(rendered.encode()).hexdigest()[:LENGTH]


def of_deployment(deployment: dict | None) -> str | None:
    """The revision a live Deployment's pod template says it runs; None without the label (a
    Deployment an operator before revisions wrote)."""
    if not deployment:
        return None
    labels = ((deployment.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
    return labels.get(names.LABEL_REVISION)


def rolled_out(deployment: dict | None) -> bool:
    """Every replica of the Deployment runs its current template and is ready (its rolling
    update is done), as the Deployment controller reports it."""
    if not deployment:
        return False
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    want = spec.get("replicas", 1)
    return (status.get("observedGeneration", 0) >= deployment.get("metadata", {}).get("generation", 0)
            and status.get("updatedReplicas", 0) == want and status.get("replicas", 0) == want
            and status.get("readyReplicas", 0) == want)
