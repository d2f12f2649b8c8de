"""Tuning without restarts, end to end: a spec.admission change on a serving replica reaches its guard
through the ConfigMap (the engine backer rewrites the mounted guard.json as the kubelet does), the
Deployment's pod template stays as it was, no request is lost and vLLM keeps its process. Then what
the replica learned of its answers' lengths reaches the same ConfigMap (demand.json), and a replica
added later starts from it before it has served anything."""
from __future__ import annotations

import asyncio
import json
import math
import re
import uuid

import aiohttp
import yaml

from gpufleet.manifests import names
from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from tests.support.waiting import wait_for

API = "serving.gpufleet.dev/v1alpha1"
KV_BLOCKS = 64


def tiny(watermark: int, replicas: int = 1) -> dict:
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "tuned"}, "spec": {
        "model": {"name": "tiny-llama", "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": KV_BLOCKS, "cpuKvCacheSpaceGiB": 1}},
        "isolation": {"nodePool": "local", "tolerations": [
            {"key": "gpufleet.dev/local-engine", "operator": "Exists", "effect": "NoSchedule"}]},
        "admission": {"requestTimeoutSeconds": 120, "kvWatermarkPercent": watermark},
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 2, "kvHighWatermarkPercent": 60,
                        "kvLowWatermarkPercent": 20}, "replicas": replicas}}


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


async def test_an_admission_change_reaches_the_serving_guard_without_a_restart(control_plane, crds_installed,
                                                                               engine_nodes, tmp_path):
    kube = control_plane.client()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"gpufleet.dev/test": "true"}}})
    op = OperatorProcess(control_plane.kubeconfig, tmp_path / "operator.log", ("--namespace", namespace)).start()
    try:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny(15)))

        async def serving_pod():
            pods = await kube.list("v1", "Pod", namespace)
            ready = [p for p in pods if any(cd["type"] == "Ready" and cd["status"] == "True"
                                            for cd in (p.get("status") or {}).get("conditions") or [])]
            return ready[0] if ready else None
        pod = await wait_for(serving_pod, timeout=300, what="a real engine replica Ready")
        guard = f"http://{pod['status']['podIP']}:{names.GUARD_PORT}"
        deployment = await kube.get("apps/v1", "Deployment", names.deployment_name("tuned"), namespace)

        async with aiohttp.ClientSession() as http:
            async def text(path: str) -> str:
                async with http.get(guard + path) as r:
                    return await r.text()
            assert metric(await text("/metrics"), "gpufleet_guard_kv_watermark_blocks") == \
                math.ceil(KV_BLOCKS * 15 / 100)
            vllm_started = metric(await text(ENGINE_METRICS_PATH), "process_start_time_seconds")
            assert vllm_started

            async def stream() -> int:
                body = {"model": "tiny-llama", "prompt": "a serving replica", "max_tokens": 600,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with http.post(guard + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    events = [json.loads(line[6:]) for line in (await r.read()).decode().splitlines()
                              if line.startswith("data: {")]
                    return events[-1]["usage"]["completion_tokens"]
            in_flight = asyncio.create_task(stream())

            control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny(30)))

            async def configmap_updated():
                cm = await kube.get("v1", "ConfigMap", names.configmap_name("tuned"), namespace)
                return json.loads(cm["data"]["guard.json"])["kvWatermarkPercent"] == 30
            await wait_for(configmap_updated, timeout=30, what="the ConfigMap to carry the new watermark")

            async def applied():
                t = await text("/metrics")
                return t if metric(t, "gpufleet_guard_kv_watermark_blocks") == math.ceil(KV_BLOCKS * 30 / 100) \
                    else None
            after = await wait_for(applied, timeout=60, what="the serving guard to apply the new watermark")
            assert metric(after, "gpufleet_guard_config_reloads_total", result="applied") >= 1
            assert await in_flight == 600  # the request in flight across the reload finished whole

            now = await kube.get("apps/v1", "Deployment", names.deployment_name("tuned"), namespace)
            assert now["spec"]["template"] == deployment["spec"]["template"]
            pods = await kube.list("v1", "Pod", namespace)
            assert [p["metadata"]["uid"] for p in pods] == [pod["metadata"]["uid"]]
            assert metric(await text(ENGINE_METRICS_PATH), "process_start_time_seconds") == vllm_started

            # Short answers teach the serving replica; the operator passes them on (within a look,
            # fleet/demand_share.py), and the replica added next starts from them.
            short = {"model": "tiny-llama", "prompt": "a short answer", "max_tokens": 5, "ignore_eos": True}
            for _ in range(20):
                async with http.post(guard + "/v1/completions", json=short) as r:
                    assert r.status == 200, await r.text()

            async def shared():
                # An earlier version may carry only the blocks held per request (heldPerRequest).
                cm = await kube.get("v1", "ConfigMap", names.configmap_name("tuned"), namespace)
                text = (cm.get("data") or {}).get(demand_prior.FILE_NAME)
                prior = demand_prior.parse(json.loads(text)) if text else None
                return prior if prior and prior.keys else None
            prior = await wait_for(shared, timeout=90, what="demand.json with the learned lengths in the ConfigMap")
            assert [(k.route, k.queue_class) for k in prior.keys] == [("/v1/completions", "standard")]
            control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny(30, replicas=2)))

            async def second_pod():
                ready = [p for p in await kube.list("v1", "Pod", namespace)
                         if p["metadata"]["uid"] != pod["metadata"]["uid"] and any(
                             cd["type"] == "Ready" and cd["status"] == "True"
                             for cd in (p.get("status") or {}).get("conditions") or [])]
                return ready[0] if ready else None
            added = await wait_for(second_pod, timeout=300, what="the added replica Ready")
            # As the operator reads it: with its guard token (guard.json's controlAuth names it).
            async with http.get(f"http://{added['status']['podIP']}:{names.GUARD_PORT}"
                                f"{demand_prior.DEMAND_PATH}",
                                headers={"Authorization": f"Bearer {op.guard_token_file.read_text()}"}) as r:
                (seeded,) = demand_prior.parse(await r.json()).keys
            # Nothing was sent to it: what it knows came with it. Mostly 5-token answers (and the
            # 600-token stream above), where an unlearned guard reserves the whole context.
            assert (seeded.route, seeded.queue_class) == ("/v1/completions", "standard")
            assert seeded.samples >= 16 and seeded.mean < 100
    finally:
        op.stop()
        await kube.delete("v1", "Namespace", namespace)
        await kube.close()


