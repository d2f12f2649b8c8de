"""Isolation verification: what actually runs on the nodes a Dedicated or
Exclusive service occupies. Pure: pods in, violations out."""
from __future__ import annotations

import dataclasses

from ..audit.stranded import pod_gpus
from ..manifests import names


@dataclasses.dataclass(frozen=True)
class Violation:
    node: str
    pod: str          # namespace/name of the offending pod
    why: str


def violations_for(service: str, namespace: str, mode: str, model_label: str, pods: list[dict]) -> list[Violation]:
    if mode not in ("Dedicated", "Exclusive"):
        return []
    mine = [p for p in pods if p["metadata"].get("namespace") == namespace
            and p["metadata"].get("labels", {}).get(names.LABEL_SERVICE) == service
            and p.get("spec", {}).get("nodeName")]
    nodes = {p["spec"]["nodeName"] for p in mine}
    out = []
    for p in pods:
        node = p.get("spec", {}).get("nodeName")
        if node not in nodes or p in mine or p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        labels = p["metadata"].get("labels", {})
        ref = f"{p['metadata'].get('namespace')}/{p['metadata']['name']}"
        other_model = labels.get(names.LABEL_MODEL)
        if other_model:
            if mode == "Exclusive" and labels.get(names.LABEL_SERVICE) != service:
                out.append(Violation(node, ref, "another managed service on an Exclusive node"))
            elif other_model != model_label:
                out.append(Violation(node, ref, f"model {other_model} on a node Dedicated to {model_label}"))
        elif pod_gpus(p) > 0:
            out.append(Violation(node, ref, "unmanaged GPU pod"))
    return sorted(out, key=lambda v: (v.node, v.pod))


class PodsByNode:
    """The pods on each node and the nodes of each service's pods, indexed once per audit pass: a
    service's violations are looked for among the pods on its own nodes only (``near``), so a pass
    over N services and their pods costs O(N), not O(N²)."""

    def __init__(self, pods: list[dict]):
        self._on: dict[str, list[dict]] = {}
        self._nodes_of: dict[tuple[str | None, str], set[str]] = {}
        for p in pods:
            node = (p.get("spec") or {}).get("nodeName")
            if not node:
                continue
            self._on.setdefault(node, []).append(p)
            service = (p["metadata"].get("labels") or {}).get(names.LABEL_SERVICE)
            if service:
                self._nodes_of.setdefault((p["metadata"].get("namespace"), service), set()).add(node)

    def near(self, namespace: str, service: str) -> list[dict]:
        """Every pod on a node where a pod of ``service`` runs (its own included)."""
        return [p for node in sorted(self._nodes_of.get((namespace, service), ())) for p in self._on[node]]
