"""The product as the real-node tests install it: the chart (the operator and the router as pods)
and the tiny sample's InferenceService, with the helpers that watch their pods. The session's
fixtures (conftest.py) install them once for every module."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpufleet.manifests import names
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
API = "serving.gpufleet.dev/v1alpha1"
SERVICE = "tiny"


@dataclass
class Install:
    operator_ns: str
    work_ns: str
    helm: str


def _delete_leftover_cluster_objects(control_plane) -> None:
    """Cluster-scoped objects of an earlier run's release that never got uninstalled (an
    interrupted run): helm refuses to adopt them into a release in another namespace."""
    out = control_plane.kubectl("get", "clusterrole,clusterrolebinding", "-o", "json").stdout
    for obj in json.loads(out)["items"]:
        release_ns = obj["metadata"].get("annotations", {}).get("meta.helm.sh/release-namespace", "")
        if release_ns.startswith("rn-operator-"):
            control_plane.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], check=False)


async def _pods(kube, ns: str, selector: str) -> list[dict]:
    return await kube.list("v1", "Pod", ns, label_selector=selector)


def _ready(pod: dict) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return conds.get("Ready") == "True"


async def _operator_pods(kube, inst: Install) -> list[dict]:
    return await _pods(kube, inst.operator_ns, "app.kubernetes.io/name=gpufleet-operator")


async def _wait_operator_ready(kube, inst: Install, control_plane, exclude: set[str] = frozenset()) -> dict:
    async def ready():
        pods = [p for p in await _operator_pods(kube, inst) if p["metadata"]["name"] not in exclude]
        return next((p for p in pods if _ready(p)), None)
    return await wait_for(ready, timeout=180, what="the operator pod Ready",
                          describe=lambda: control_plane.kubectl(
                              "-n", inst.operator_ns, "describe", "pods", check=False).stdout[-3000:])


def _sample(image: str) -> dict:
    sample = yaml.safe_load((ROOT / "samples" / "real-node-tiny.yaml").read_text())
    sample["spec"]["engine"]["image"] = image
    return sample


async def _service_ready(kube, ns: str, replicas: int, service: str = SERVICE) -> bool:
    pods = [p for p in await _pods(kube, ns, names.selector_string(service)) if not p["metadata"].get(
        "deletionTimestamp")]
    return len(pods) == replicas and all(_ready(p) for p in pods)


async def _service_settled(kube, ns: str, replicas: int, service: str = SERVICE) -> bool:
    """``replicas`` Ready pods and none still terminating (a scaled-in pod drains for a while): how a test
    leaves the session's service for the next one, which counts its pods."""
    pods = await _pods(kube, ns, names.selector_string(service))
    return len(pods) == replicas and all(_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)


async def _cluster_ip(kube, ns: str) -> str:
    svc = await kube.get("v1", "Service", names.service_name(SERVICE), ns)
    return svc["spec"]["clusterIP"]


def exec_get(control_plane, ns: str, pod: str, container: str, url: str) -> str:
    """GET ``url`` from inside a pod's container (its loopback): what the guard or router serves there."""
    return control_plane.kubectl("-n", ns, "exec", pod, "-c", container, "--", "python3", "-c",
                                 f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
                                 ).stdout


def metric_sum(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
