"""The demo's baseline: the same vLLM on the same node, alone.

One Pod that runs only the engine container of the operator's own pod template (the same image,
command, flags, environment, CPU request and placement), with vLLM listening on the pod's address
instead of its loopback, so the demo's clients reach vLLM's port directly: no guard, no operator,
one replica (the service's starting count). It is demo-only: a Pod the demo creates and deletes
itself; nothing in the product's API turns the guard off.

The builders are pure; ``start`` and ``stop`` do the I/O.
"""
from __future__ import annotations

import asyncio
import copy
import time

import msgspec

from gpufleet.manifests import children, names
from gpufleet.manifests import guard_config as guard_manifest
from gpufleet_api import InferenceServiceSpec, parse_spec
from gpufleet_api.guard import guard_config
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.pods import is_serving

LABEL = "gpufleet.dev/demo-run"
RUN = "vllm-alone"
# vLLM on every address of the pod: the demo's clients and Prometheus reach it from the host.
LISTEN_HOST = "0.0.0.0"


def pod_name(service: str) -> str:
    return f"{service}-{RUN}"


def selector() -> str:
    return f"{LABEL}={RUN}"


def guard_json(isvc: dict, spec: InferenceServiceSpec) -> str:
    """The guard.json the operator would write for ``isvc``, its vLLM listening on the pod's address.
    The engine container reads only its ``engine`` section (flags.vllm_launch)."""
    meta = isvc["metadata"]
    config = guard_manifest.build_guard_config(meta["name"], meta["namespace"], spec)
    assert config.engine is not None
    engine = msgspec.structs.replace(config.engine, host=LISTEN_HOST)
    return guard_config.render(msgspec.structs.replace(config, engine=engine))


def build(isvc: dict) -> tuple[dict, dict]:
    """(ConfigMap, Pod) of the baseline for the InferenceService document ``isvc`` (not applied)."""
    spec = parse_spec(isvc["spec"])
    meta = isvc["metadata"]
    name = pod_name(meta["name"])
    owned = {**isvc, "metadata": {**meta, "uid": meta.get("uid", "")}}
    deployment = children.build_deployment(owned, spec, 1, config_hash="")
    template = copy.deepcopy(deployment["spec"]["template"])
    pod_spec = template["spec"]
    engine = next(c for c in pod_spec["containers"] if c["name"] == "vllm")
    engine.pop("lifecycle", None)  # its preStop waits for a guard that is not there
    engine["ports"] = [{"name": "vllm", "containerPort": names.ENGINE_PORT}]
    engine["readinessProbe"] = {"httpGet": {"path": "/health", "port": "vllm"}, "periodSeconds": 2,
                                "failureThreshold": 2, "timeoutSeconds": 2}
    pod_spec["containers"] = [engine]
    pod_spec["terminationGracePeriodSeconds"] = 5
    pod_spec["restartPolicy"] = "Never"  # a vLLM that exits fails the demo with its log, not a crash loop
    for volume in pod_spec["volumes"]:
        if "configMap" in volume:
            volume["configMap"] = {"name": name}
    labels = {LABEL: RUN, "app.kubernetes.io/part-of": "gpufleet-demo"}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels},
                  "data": {names.guard_config_key("unified"): guard_json(owned, spec)}}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels},
           "spec": pod_spec}
    return config_map, pod


def endpoint(pod: dict) -> str:
    return f"http://{pod['status']['podIP']}:{names.ENGINE_PORT}"


async def start(kube: KubeClient, isvc: dict, timeout: float = 600) -> dict:
    """Create the baseline and wait until vLLM answers its readiness probe; the ready Pod."""
    config_map, pod = build(isvc)
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    await stop(kube, namespace, name)
    await kube.apply(config_map, field_manager="gpufleet-demo")
    await kube.create(pod)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = await kube.get_or_none("v1", "Pod", name, namespace)
        if live and is_serving(live):
            return live
        if live and (live.get("status") or {}).get("phase") == "Failed":
            raise RuntimeError(f"vLLM alone exited in the baseline pod {namespace}/{name}; see "
                               f"`kubectl -n {namespace} logs {name}`")
        await asyncio.sleep(1)
    raise RuntimeError(f"the baseline pod {namespace}/{name} (vLLM alone) did not become ready in {timeout:.0f}s; "
                       f"see `kubectl -n {namespace} describe pod {name}` and its logs")


async def stop(kube: KubeClient, namespace: str, name: str, timeout: float = 120) -> None:
    """Delete the baseline Pod and ConfigMap and wait until the Pod is gone (its CPU is the next run's)."""
    # The pod's own 5 s grace, not 0: the object goes only once the kubelet has stopped vLLM.
    await kube.delete("v1", "Pod", name, namespace)
    await kube.delete("v1", "ConfigMap", name, namespace)
    deadline = time.monotonic() + timeout
    while await kube.get_or_none("v1", "Pod", name, namespace):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the baseline pod {namespace}/{name} was not gone after {timeout:.0f}s")
        await asyncio.sleep(1)
