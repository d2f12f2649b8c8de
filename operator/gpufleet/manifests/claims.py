"""A PersistentVolumeClaim the operator creates for a service (the model cache, the KV store). Pure."""
from __future__ import annotations

from typing import Any

from . import names


def owned_claim(isvc: dict, name: str, claim: Any) -> dict:
    """``claim``: a spec claim with size, accessMode (default ReadWriteMany) and storageClassName; the
    object is owned by the InferenceService and deleted with it."""
    pvc_spec: dict = {"accessModes": [claim.access_mode or "ReadWriteMany"],
                      "resources": {"requests": {"storage": str(claim.size)}}}
    if claim.storage_class_name:
        pvc_spec["storageClassName"] = claim.storage_class_name
    service = isvc["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": isvc["metadata"]["namespace"],
                     "labels": names.common_labels(service), "ownerReferences": [names.owner_reference(isvc)]},
        "spec": pvc_spec,
    }
