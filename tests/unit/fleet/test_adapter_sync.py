"""The adapters pass of a service's loop against fake guards and an in-memory API server: sets PUT
only where they differ (a restarted replica gets its set back), status written on change only,
Events on a new failure reason, backoff for a broken guard, ServiceNotFound for an orphan."""
import msgspec

from gpufleet.adapters.index import AdapterIndex
from gpufleet.fleet.adapter_sync import BACKOFF_MIN_S, SYNC_SECONDS, AdapterSync, OrphanAdapters
from gpufleet.fleet.ports import ServicePorts
from gpufleet.metrics import OperatorMetrics
from gpufleet_api import parse_spec
from gpufleet_api.guard.adapters import AdapterReport, AdapterState, spec_digest
from tests.support.fake_kube import FakeKube

API = "serving.gpufleet.dev/v1alpha1"


class FakeGuards:
    """Each replica's guard: it holds what it was last PUT, each adapter in ``state`` (Loaded unless
    said), and answers nothing while ``down``."""

    def __init__(self):
        self.held: dict[str, AdapterReport] = {}
        self.state: dict[str, AdapterState] = {}
        self.puts: list[tuple[str, list[str]]] = []
        self.down: set[str] = set()

    async def adapters(self, pod, ip):
        if pod in self.down:
            return None, "ConnectionRefused"
        return self.held.get(pod, AdapterReport(max_adapters=32)), None

    async def put_adapters(self, pod, ip, wanted):
        if pod in self.down:
            return "ConnectionRefused"
        names = [a.name for a in wanted.adapters]
        self.puts.append((pod, names))
        self.held[pod] = AdapterReport(adapters=tuple(
            self.state.get(a.name, AdapterState(name=a.name, state="Loaded", digest=spec_digest(a)))
            for a in wanted.adapters), max_adapters=32)
        return None

    def restart(self, pod):
        self.held.pop(pod, None)


def adapter(kube, name, service="chat"):
    return kube.put({"apiVersion": API, "kind": "InferenceAdapter",
                     "metadata": {"name": name, "namespace": "ml"},
                     "spec": {"service": service, "source": {"uri": f"https://store/{name}.tar"}}})


def pod(name):
    return {"name": name, "ip": "10.0.0.1", "ready": True, "deleting": False}


def setup(n=2, **lora):
    kube, guards = FakeKube(), FakeGuards()
    ports = ServicePorts(events=kube, status=None, locks=None, objects=kube, replicas=guards,  # type: ignore[arg-type]
                         metrics=OperatorMetrics())
    index = AdapterIndex()
    for i in range(n):
        index.upsert(adapter(kube, f"a{i}"))
    spec = parse_spec({"model": {"name": "m"}, "engine": {"lora": lora}})
    return kube, guards, index, AdapterSync(ports, "ml", "chat"), spec


def refresh(kube, index):
    for key, obj in kube.objects.items():
        if key[0] == "InferenceAdapter":
            index.upsert(obj)


async def test_each_replica_gets_its_set_once_and_the_status_says_where_it_is_loaded():
    kube, guards, index, sync, spec = setup()
    ready = [pod("p1"), pod("p2")]
    await sync.tick(spec, ready, index.of("ml", "chat"), 0.0)
    assert sorted(p for p, _ in guards.puts) == ["p1", "p2"]
    refresh(kube, index)
    await sync.tick(spec, ready, index.of("ml", "chat"), SYNC_SECONDS)
    assert len(guards.puts) == 2   # nothing changed: nothing sent
    status = kube.obj("InferenceAdapter", "a0")["status"]
    assert status["conditions"][0]["reason"] == "Loaded" and status["loadedReplicas"] >= 1
    writes = len(kube.writes)
    await sync.tick(spec, ready, index.of("ml", "chat"), 2 * SYNC_SECONDS)
    assert len(kube.writes) == writes   # the same status is not written again


async def test_a_restarted_replica_gets_its_set_back_and_a_deleted_adapter_is_unloaded():
    kube, guards, index, sync, spec = setup()
    ready = [pod("p1"), pod("p2")]
    await sync.tick(spec, ready, index.of("ml", "chat"), 0.0)
    before = dict(guards.held)
    guards.restart("p1")
    await sync.tick(spec, ready, index.of("ml", "chat"), SYNC_SECONDS)
    assert guards.puts[-1][0] == "p1" and guards.held["p1"] == before["p1"]
    index.remove("ml", "a0")
    await sync.tick(spec, ready, index.of("ml", "chat"), SYNC_SECONDS + 0.1)   # changed adapters: at once
    assert all("a0" not in [a.name for a in r.adapters] for r in guards.held.values())


async def test_a_replica_serving_another_source_under_a_wanted_name_gets_its_set_again():
    kube, guards, index, sync, spec = setup(n=1)
    ready = [pod("p1")]
    await sync.tick(spec, ready, index.of("ml", "chat"), 0.0)
    held = guards.held["p1"]
    # Someone else's PUT kept the name and swapped the source: the report's digest says so.
    guards.held["p1"] = msgspec.structs.replace(held, adapters=tuple(
        msgspec.structs.replace(a, digest="sha256:" + "0" * 64) for a in held.adapters))
    await sync.tick(spec, ready, index.of("ml", "chat"), SYNC_SECONDS)
    assert guards.puts == [("p1", ["a0"]), ("p1", ["a0"])] and guards.held["p1"] == held


async def test_a_failure_is_reported_with_an_event_once_and_a_broken_guard_is_backed_off():
    kube, guards, index, sync, spec = setup(n=1)
    guards.state["a0"] = AdapterState(name="a0", state="Failed", reason="MissingFiles",
                                      message="adapter_config.json not found")
    ready = [pod("p1")]
    await sync.tick(spec, ready, index.of("ml", "chat"), 0.0)
    await sync.tick(spec, ready, index.of("ml", "chat"), SYNC_SECONDS)
    ready_c = kube.obj("InferenceAdapter", "a0")["status"]["conditions"][0]
    assert (ready_c["reason"], ready_c["message"]) == ("MissingFiles", "p1: adapter_config.json not found")
    await sync.tick(spec, ready, index.of("ml", "chat"), 2 * SYNC_SECONDS)
    assert kube.event_reasons("a0") == ["MissingFiles"]
    guards.down.add("p1")
    reads = len(guards.puts)
    await sync.tick(spec, ready, index.of("ml", "chat"), 3 * SYNC_SECONDS)
    assert sync.backoff.waiting("p1", 3 * SYNC_SECONDS + BACKOFF_MIN_S / 2)
    assert len(guards.puts) == reads


async def test_a_service_without_lora_says_so_on_its_adapters():
    kube, guards, index, sync, _ = setup(n=1)
    await sync.tick(parse_spec({"model": {"name": "m"}}), [pod("p1")], index.of("ml", "chat"), 0.0)
    assert kube.obj("InferenceAdapter", "a0")["status"]["conditions"][0]["reason"] == "LoraDisabled"
    assert guards.puts == []


async def test_adapters_of_a_missing_service_get_service_not_found_after_the_grace():
    kube, _, index, sync, _ = setup(n=1)
    orphans = OrphanAdapters(sync.ports)
    await orphans.tick(index.of("ml", "chat"), watching_for=1.0)
    assert "status" not in kube.obj("InferenceAdapter", "a0")
    await orphans.tick(index.of("ml", "chat"), watching_for=OrphanAdapters.GRACE_S)
    assert kube.obj("InferenceAdapter", "a0")["status"]["conditions"][0]["reason"] == "ServiceNotFound"
    assert kube.event_reasons("a0") == ["ServiceNotFound"]


async def test_an_adapters_request_rate_alone_is_written_at_most_once_per_figures_interval():
    from gpufleet.adapters import status as adapter_status
    from gpufleet.fleet.adapter_sync import StatusWriter
    from gpufleet.reconcile.figures import TIME_FIELD

    kube, _, index, sync, _ = setup(n=1)
    clock = [1000.0]
    writer = StatusWriter(sync.ports, figures_interval=20, clock=lambda: clock[0])
    seen = adapter_status.Observed(holders=["p1"], reports={"p1": AdapterReport(
        adapters=(AdapterState(name="a0", state="Loaded"),), max_adapters=32)}, rate=1.0)

    def writes():
        return [b["status"] for verb, key, b in kube.writes if key[0] == "InferenceAdapter"]

    async def observe(rate, generation=1, at=None):
        clock[0] = at if at is not None else clock[0] + 1
        refresh(kube, index)
        new = adapter_status.adapter_status("a0", "chat", generation, adapter_status.Observed(
            **{**seen.__dict__, "rate": rate}))
        await writer.write(index.of("ml", "chat")[0], new)

    await observe(1.0)
    assert len(writes()) == 1 and TIME_FIELD in writes()[0]
    for i in range(10):                   # the rate doubles and halves every pass: paced
        await observe(2.0 if i % 2 == 0 else 1.0)
    assert len(writes()) == 1
    await observe(2.0, at=1021.0)
    assert len(writes()) == 2 and writes()[-1]["requestsPerSecond"] == "2.00"
    await observe(4.0, generation=2)      # another change: at once, the rate riding along
    assert len(writes()) == 3 and writes()[-1]["requestsPerSecond"] == "4.00" and TIME_FIELD in writes()[-1]
