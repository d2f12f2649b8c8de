"""LoRA adapters on the real node: a service of the CPU engine image with spec.engine.lora, real PEFT adapters
(tests/support/lora_adapters.py) declared as InferenceAdapters whose source is a tar archive served from the
node's address, reached through the chart's router with the openai SDK. Adapters are added and removed while
clients stream through the base model and through another adapter, and the service scales out under that
load: no request fails, and the new replica gets its adapters before the router sends it their traffic.

This module's service is deleted at its end, so the real node's two cores are the other modules' again.
"""
from __future__ import annotations

import asyncio
import io
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import yaml

from gpufleet.manifests import names
from gpufleet_api import GROUP, VERSION
from gpufleet_dev.devcluster import node
from tests.realnode.load import model_listed, streaming
from tests.realnode.product import _pods, _ready, _sample
from tests.support.lora_adapters import make_adapter, make_adapters
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(900)

API = f"{GROUP}/{VERSION}"
SERVICE = "tiny-lora"
MODEL = "tiny-lora"        # its own served name: the session's tiny sample serves tiny-llama
PROMPT = "The capital of the bicycle shop is"


class AdapterServer:
    """Each adapter's folder as a tar.gz at /<name>.tar.gz, on the node's address (pods reach it through
    the bridge), served from a thread so the tests' own event loops need not run it."""

    def __init__(self, folders: dict[str, Path]):
        self.archives = {name: _tar(folder) for name, folder in folders.items()}
        self.requested: list[str] = []
        self._server: ThreadingHTTPServer | None = None

    def start(self, host: str) -> str:
        archives, requested = self.archives, self.requested

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                requested.append(self.path)
                body = archives.get(self.path.strip("/").removesuffix(".tar.gz"))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:
                pass
        self._server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://{host}:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()


def _tar(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(folder.iterdir()):
            if p.is_file():
                tar.add(p, arcname=p.name)
    return buf.getvalue()


def _adapter(name: str, url: str) -> dict:
    return {"apiVersion": API, "kind": "InferenceAdapter", "metadata": {"name": name},
            "spec": {"service": SERVICE, "source": {"uri": f"{url}/{name}.tar.gz"}}}


async def _adapter_status(kube, ns: str, name: str) -> dict:
    return (await kube.get(API, "InferenceAdapter", name, ns)).get("status") or {}


async def _ready_on(kube, ns: str, name: str, replicas: int = 1) -> bool:
    status = await _adapter_status(kube, ns, name)
    ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
    return ready.get("status") == "True" and status.get("loadedReplicas", 0) >= replicas


async def _engine_pods(kube, ns: str) -> list[dict]:
    return [p for p in await _pods(kube, ns, names.selector_string(SERVICE)) if not p["metadata"].get(
        "deletionTimestamp")]


async def _greedy(client: openai.AsyncOpenAI, model: str) -> str:
    out = await client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    return out.choices[0].text


@pytest.fixture(scope="module")
def adapters():
    """Three rank-8 adapters and one of rank 64 (above the service's maxRank 8)."""
    folders = make_adapters(3, prefix="rn")
    folders["rn-wide"] = make_adapter("rn-wide", rank=64)
    return folders


@pytest.fixture(scope="module")
def lora_service(install, control_plane, built_images, adapters):
    """The tiny sample with LoRA on, one replica Ready; yields (router ClusterIP, adapter server URL).
    Deleted at the module's end."""
    sample = _sample(built_images["engine-cpu"])
    sample["metadata"]["name"] = SERVICE
    sample["spec"]["model"]["servedName"] = MODEL
    sample["spec"]["engine"]["lora"] = {"maxAdaptersPerBatch": 2, "maxRank": 8, "maxAdapters": 4}
    server = AdapterServer(adapters)
    url = server.start(node.NODE_IP)
    control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-", input=yaml.safe_dump(sample))

    async def ready() -> str:
        kube = control_plane.client()
        try:
            async def one_ready() -> bool:
                pods = await _engine_pods(kube, install.work_ns)
                return len(pods) == 1 and _ready(pods[0])
            await wait_for(one_ready, timeout=480, what="the LoRA service's pod Ready on the real node",
                           describe=lambda: control_plane.kubectl("-n", install.work_ns, "describe", "pods",
                                                                  check=False).stdout[-4000:])
            svc = await kube.get("v1", "Service", "gpufleet-router", install.operator_ns)
            return svc["spec"]["clusterIP"]
        finally:
            await kube.close()
    try:
        yield asyncio.run(ready()), url
    finally:
        control_plane.kubectl("-n", install.work_ns, "delete", "inferenceadapters", "--all", "--wait=true",
                              "--timeout=60s", check=False)
        control_plane.kubectl("-n", install.work_ns, "delete", "inferenceservice", SERVICE, "--wait=true",
                              "--timeout=120s", check=False)
        server.stop()


def _describe(control_plane, install) -> str:
    """The adapters' status and the engine guards' log: what a failed wait shows."""
    ns = install.work_ns
    return (control_plane.kubectl("-n", ns, "get", "inferenceadapters", "-o", "yaml", check=False).stdout[-2500:]
            + "\nguard log:\n" + control_plane.kubectl("-n", ns, "logs", "-l", names.selector_string(SERVICE), "-c",
                                                      "guard", "--tail=40", check=False).stdout[-4000:])


async def test_an_adapter_is_served_through_the_router_and_differs_from_the_base(
        lora_service, install, kube, control_plane):
    ip, url = lora_service
    control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-", input=yaml.safe_dump(_adapter("rn-1", url)))
    describe = lambda: _describe(control_plane, install)  # noqa: E731
    await wait_for(lambda: _ready_on(kube, install.work_ns, "rn-1"), timeout=180,
                   what="rn-1 Ready and loaded on the replica", describe=describe)
    client = openai.AsyncOpenAI(base_url=f"http://{ip}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        await wait_for(lambda: model_listed(client, "rn-1"), timeout=60, what="the router listing rn-1")
        models = {m.id: m for m in (await client.models.list()).data}
        assert getattr(models["rn-1"], "parent", None) == MODEL, models["rn-1"]
        base, tuned = await _greedy(client, MODEL), await _greedy(client, "rn-1")
        assert base != tuned, (base, tuned)
        with pytest.raises(openai.NotFoundError) as e:
            await _greedy(client, "no-such-adapter")
        assert "no-such-adapter" in str(e.value) and "rn-1" in str(e.value)
    finally:
        await client.close()


async def test_a_rank_above_the_limit_gets_its_reason_and_disturbs_nothing(
        lora_service, install, kube, control_plane):
    ip, url = lora_service
    control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-", input=yaml.safe_dump(_adapter("rn-wide", url)))

    async def refused() -> dict | None:
        status = await _adapter_status(kube, install.work_ns, "rn-wide")
        ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        return ready if ready.get("status") == "False" and ready.get("reason") == "RankTooHigh" else None
    ready = await wait_for(refused, timeout=180, what="rn-wide Ready=False RankTooHigh",
                           describe=lambda: _describe(control_plane, install))
    assert "64" in ready["message"], ready
    client = openai.AsyncOpenAI(base_url=f"http://{ip}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        assert await _greedy(client, "rn-1") and await _greedy(client, MODEL)
    finally:
        await client.close()

    # The operator posts the Event after the status write (fleet/adapter_sync.py): waited for, not read once.
    def events() -> str:
        return control_plane.kubectl("-n", install.work_ns, "get", "events", "--field-selector",
                                     "involvedObject.name=rn-wide", check=False).stdout
    await wait_for(lambda: "RankTooHigh" in events(), timeout=60, what="a RankTooHigh Event on rn-wide",
                   describe=events)
    control_plane.kubectl("-n", install.work_ns, "delete", "inferenceadapter", "rn-wide", "--wait=true")


async def test_adapters_added_removed_and_a_scale_out_under_streaming_load_fail_no_request(
        lora_service, install, kube, control_plane):
    ip, url = lora_service
    client = openai.AsyncOpenAI(base_url=f"http://{ip}/v1", api_key="none", max_retries=0, timeout=90)
    describe = lambda: _describe(control_plane, install)  # noqa: E731
    try:
        async with streaming(client, model=MODEL, clients=1) as base, \
                streaming(client, model="rn-1", clients=1) as tuned:
            await wait_for(lambda: base.ok >= 2 and tuned.ok >= 2, timeout=120, what="streams answered")
            # Added: rn-2 loads into the running replica (no restart) and answers.
            control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-",
                                  input=yaml.safe_dump(_adapter("rn-2", url)))
            await wait_for(lambda: _ready_on(kube, install.work_ns, "rn-2"), timeout=180,
                           what="rn-2 loaded", describe=describe)
            await wait_for(lambda: model_listed(client, "rn-2"), timeout=60, what="the router listing rn-2")
            assert await _greedy(client, "rn-2")
            # Scale out under load: the new replica gets rn-1 and rn-2 before their traffic reaches it.
            await kube.merge_patch(API, "InferenceService", SERVICE, {"spec": {"autoscaling": {"minReplicas": 2}}},
                                   install.work_ns)

            async def two_ready() -> bool:
                pods = await _engine_pods(kube, install.work_ns)
                return len(pods) == 2 and all(_ready(p) for p in pods)
            await wait_for(two_ready, timeout=480, what="the second replica Ready", describe=describe)
            mark = tuned.ok
            await wait_for(lambda: tuned.ok >= mark + 4, timeout=120, what="rn-1 streams after the scale-out")
            # Removed: rn-2 unloaded and no longer listed; rn-1's stream goes on.
            control_plane.kubectl("-n", install.work_ns, "delete", "inferenceadapter", "rn-2", "--wait=true")
            await wait_for(lambda: _not_listed(client, "rn-2"), timeout=60, what="rn-2 gone from /v1/models")
            mark = tuned.ok
            await wait_for(lambda: tuned.ok >= mark + 2, timeout=120, what="rn-1 streams after rn-2 left")
        restarts = [c["restartCount"] for p in await _engine_pods(kube, install.work_ns)
                    for c in p["status"]["containerStatuses"]]
    finally:
        await client.close()
    assert base.errors == [] and tuned.errors == [], (base.errors[:5], tuned.errors[:5])
    assert base.ok > 4 and tuned.ok > 4
    assert restarts == [0] * len(restarts), restarts  # adapters came and went without restarting an engine


async def _not_listed(client: openai.AsyncOpenAI, model: str) -> bool:
    try:
        return model not in [m.id async for m in client.models.list()]
    except openai.APIError:
        return False
