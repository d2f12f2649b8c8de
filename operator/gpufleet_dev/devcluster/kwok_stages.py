"""kwok's lifecycle stages for the local fleet.

Ordinary simulated nodes use kwok's default stages: pods become Running and
Ready at once, and are removed at once when deleted. Engine nodes
(``engine-node-*``) are different: their pods are backed by real local
processes (``gpufleet_dev.devcluster.engines``), so kwok only marks them Running
with an address, the backer reports readiness from the real guard, and kwok
removes a deleted pod only after the backer has drained and stopped it.
"""
from __future__ import annotations

from pathlib import Path

import yaml

ENGINE_NODE_PREFIX = "engine-node-"
TERMINATED_ANNOTATION = "gpufleet.dev/local-process-terminated"


def _not_on(nodes: list[str]) -> dict:
    return {"key": ".spec.nodeName", "operator": "NotIn", "values": nodes}


def _on(nodes: list[str]) -> dict:
    return {"key": ".spec.nodeName", "operator": "In", "values": nodes}


ENGINE_POD_START = """
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: EngineStarting
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
{{ $hostIPs := NodeIPsWith .spec.nodeName }}
{{ with $hostIPs }}
hostIP: {{ index . 0 | Quote }}
{{ end }}
{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
{{ with $podIPs }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""


def compose(stage_dir: Path, engine_nodes: list[str]) -> str:
    docs = []
    for f in sorted(stage_dir.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        if engine_nodes and doc["spec"]["resourceRef"]["kind"] == "Pod":
            doc["spec"]["selector"]["matchExpressions"].append(_not_on(engine_nodes))
        docs.append(doc)
    if engine_nodes:
        docs.append({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
                     "metadata": {"name": "engine-pod-start"},
                     "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                              "selector": {"matchExpressions": [
                                  {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                                  {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                                  _on(engine_nodes)]},
                              "next": {"statusTemplate": ENGINE_POD_START}}})
        docs.append({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage",
                     "metadata": {"name": "engine-pod-delete"},
                     "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"},
                              "selector": {"matchExpressions": [
                                  {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                                  {"key": f'.metadata.annotations["{TERMINATED_ANNOTATION}"]',
                                   "operator": "In", "values": ["true"]},
                                  _on(engine_nodes)]},
                              "next": {"delete": True}}})
    return yaml.safe_dump_all(docs, sort_keys=False)
