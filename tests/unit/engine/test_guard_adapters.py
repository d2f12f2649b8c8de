"""The guard's LoRA adapter agent without vLLM: the book's decisions, the fetch and the check of an
adapter's files, PUT /adapters' answers, and a request for an adapter not loaded here (issue 32)."""
from __future__ import annotations

import asyncio
import functools
import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from gpufleet_api import typed
from gpufleet_api.guard import guard_config
from gpufleet_api.guard.adapters import AdapterSet, AdapterSource, AdapterSpec, HuggingFaceAdapterSource
from gpufleet_api.guard.guard_config import AdapterFetchConfig, LoraConfig
from gpufleet_engine.admission.core import Admission
from gpufleet_engine.admission.grants import Rejection
from gpufleet_engine.serving import adapter_check, adapter_fetch
from gpufleet_engine.serving.adapter_book import AdapterBook, backoff
from gpufleet_engine.serving.adapter_check import AdapterProblem, same_model
from gpufleet_engine.serving.adapters import AdapterAgent
from gpufleet_engine.serving.prometheus import GuardMetrics


def spec(name: str, path: str = "/a") -> AdapterSpec:
    return AdapterSpec(name, AdapterSource(path=f"{path}/{name}"))


def kinds(book: AdapterBook, now: float = 0.0, busy: Counter | None = None, up: bool = True) -> list[tuple[str, str]]:
    busy = busy or Counter()
    return [(s.kind, s.name) for s in book.next_steps(now, lambda n: busy[n], up)]


def loaded_book(*names: str) -> AdapterBook:
    book = AdapterBook()
    book.desire(AdapterSet(tuple(spec(n) for n in names)), 0)
    for n in names:
        book.fetched(n, spec(n), Path(f"/a/{n}"), 8, 0)
        book.loaded(n, spec(n), 0)
    return book


# --- the book ---------------------------------------------------------------------

def test_a_new_adapter_is_fetched_then_loaded_then_served():
    book = AdapterBook()
    book.desire(AdapterSet((spec("a"),)), 0)
    assert kinds(book) == [("fetch", "a")] and not book.serves("a")
    book.fetched("a", spec("a"), Path("/a/a"), 8, 1)
    assert kinds(book, up=False) == []            # vLLM is asked only while it answers
    assert kinds(book) == [("load", "a")]
    book.loaded("a", spec("a"), 2)
    assert kinds(book) == [] and book.serves("a")
    assert book.report(32, 2, 2).adapters[0].state == "Loaded"


def test_the_same_set_twice_changes_nothing():
    book = loaded_book("a")
    book.desire(AdapterSet((spec("a"),)), 5)
    assert kinds(book) == [] and book.serves("a")


def test_a_removed_adapter_leaves_vllm_only_when_no_request_uses_it():
    book = loaded_book("a", "b")
    book.desire(AdapterSet((spec("b"),)), 1)
    assert not book.serves("a") and book.serves("b")
    assert kinds(book, busy=Counter({"a": 1})) == []
    assert kinds(book) == [("unload", "a")]
    book.unloaded("a")
    assert kinds(book) == [("forget", "a")]
    book.forgotten("a")
    assert book.names() == {"b"}


def test_an_adapter_vllm_lost_is_loaded_again():
    book = loaded_book("a", "b")
    assert book.engine_holds({"b"}, 3) == ["a"]    # vLLM restarted and came back with b only
    assert not book.serves("a")
    assert kinds(book) == [("load", "a")]


def test_an_adapter_vllm_holds_that_nobody_wants_is_unloaded():
    book = AdapterBook()
    book.engine_holds({"stray"}, 0)
    assert kinds(book) == [("unload", "stray")]


def test_only_an_unreachable_source_is_tried_again_with_backoff():
    book = AdapterBook()
    book.desire(AdapterSet((spec("a"), spec("b"))), 0)
    book.failed("a", spec("a"), "SourceUnreachable", "timeout", 10)
    book.failed("b", spec("b"), "RankTooHigh", "r 64", 10)
    assert kinds(book, now=10 + backoff(1) - 0.1) == []
    assert kinds(book, now=10 + backoff(1)) == [("fetch", "a")]
    assert backoff(1) < backoff(3) <= backoff(30) == 300
    assert book.next_retry() == 10 + backoff(1)


def test_a_changed_source_is_unloaded_then_fetched_anew():
    book = loaded_book("a")
    book.desire(AdapterSet((spec("a", "/new"),)), 1)
    assert kinds(book) == [("unload", "a")]
    book.unloaded("a")
    assert kinds(book) == [("fetch", "a")]


# --- the check --------------------------------------------------------------------

def adapter(folder: Path, r: int = 8, base: str | None = None, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": r, "base_model_name_or_path": base}))
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"w")
    return folder


def reason(call) -> str:
    with pytest.raises(AdapterProblem) as e:
        call()
    return e.value.reason


def test_the_check_names_what_is_wrong(tmp_path):
    check = adapter_check.check
    assert check(adapter(tmp_path / "ok", 8, "org/Tiny-Llama"), max_rank=8, served_model="org/tiny-llama").rank == 8
    assert reason(lambda: check(adapter(tmp_path / "w", weights=False), max_rank=8, served_model="m")) == "MissingFiles"
    assert reason(lambda: check(tmp_path / "nothing", max_rank=8, served_model="m")) == "MissingFiles"
    assert reason(lambda: check(adapter(tmp_path / "r", 16), max_rank=8, served_model="m")) == "RankTooHigh"
    assert reason(lambda: check(adapter(tmp_path / "b", 8, "meta-llama/Llama-3.1-70B"), max_rank=8,
                                served_model="meta-llama/Llama-3.1-8B")) == "WrongBaseModel"
    assert reason(lambda: check(adapter(tmp_path / "d"), max_rank=8, served_model="org/llama-8b",
                                base_model="org/mistral-7b")) == "WrongBaseModel"


def test_base_models_differ_only_when_their_names_clearly_do():
    assert same_model("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B")
    assert same_model("/models/chat", "meta-llama/Llama-3.1-8B")          # a folder says nothing
    assert same_model("/cache/models--org--tiny/snapshots/abc", "org/tiny")
    assert not same_model("/cache/models--org--tiny/snapshots/abc", "org/other")
    assert not same_model("Qwen/Qwen2-7B", "meta-llama/Llama-3.1-8B")


# --- the fetch --------------------------------------------------------------------

def archive(path: Path, members: dict[str, bytes], *, link: str | None = None, prefix: str = "") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo("evil")
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
    return path


FILES = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w"}


@pytest.fixture
def files():
    from tests.support.file_server import FileServer
    server = FileServer()
    yield server
    server.close()


# Archives come from a server on loopback, which only a guard allowed private sources fetches from.
ALLOW = AdapterFetchConfig(allow_private_sources=True)


def test_a_uri_archive_is_extracted_into_the_adapter_folder(tmp_path, files):
    for prefix in ("", "my-adapter/"):
        src = archive(tmp_path / f"a{len(prefix)}.tar.gz", FILES, prefix=prefix)
        uri = files.body(f"/{src.name}", src.read_bytes())
        got = adapter_fetch.fetch(AdapterSpec("x", AdapterSource(uri=uri)), tmp_path / "dir", limits=ALLOW)
        assert (got / "adapter_config.json").read_bytes() == b'{"r": 8}'
        assert got.is_relative_to(tmp_path / "dir" / "x")


@pytest.mark.parametrize("members,link", [({"../escape": b"x", **FILES}, None), ({"/etc/x": b"x"}, None),
                                          (FILES, "/etc/passwd")])
def test_an_archive_that_reaches_outside_its_folder_is_refused(tmp_path, files, members, link):
    src = archive(tmp_path / "bad.tar.gz", members, link=link)
    uri = files.body("/bad.tar.gz", src.read_bytes())
    fetch = functools.partial(adapter_fetch.fetch, limits=ALLOW)
    assert reason(lambda: fetch(AdapterSpec("x", AdapterSource(uri=uri)), tmp_path / "dir")) == "MissingFiles"
    assert not (tmp_path / "escape").exists() and not (tmp_path / "dir" / "x").exists()
    assert list((tmp_path / "dir").iterdir()) == []


def test_an_unreachable_uri_and_a_failed_download_are_unreachable(tmp_path):
    fetch = functools.partial(adapter_fetch.fetch, limits=ALLOW)
    http = AdapterSpec("x", AdapterSource(uri="http://127.0.0.1:9/a.tar.gz"))
    assert reason(lambda: fetch(http, tmp_path)) == "SourceUnreachable"

    def hub_down(**kwargs):
        raise OSError("no route")
    hub = AdapterSpec("h", AdapterSource(hugging_face=HuggingFaceAdapterSource("org/a", "v1")))
    assert reason(lambda: fetch(hub, tmp_path, download=hub_down)) == "SourceUnreachable"


def test_a_hub_adapter_is_downloaded_at_its_revision_into_its_folder(tmp_path):
    asked = {}

    def download(repo_id, revision, local_dir):
        asked.update(repo=repo_id, revision=revision)
        adapter(Path(local_dir))
        return local_dir
    hub = AdapterSpec("h", AdapterSource(hugging_face=HuggingFaceAdapterSource("org/a", "v1")))
    got = adapter_fetch.fetch(hub, tmp_path, download=download)
    assert asked == {"repo": "org/a", "revision": "v1"} and (got / "adapter_config.json").exists()
    assert got.is_relative_to(tmp_path / "h")


# --- PUT /adapters and the request path ----------------------------------------------

class _Upstream:
    session = None

    def url(self, path: str) -> str:
        return path


def agent(max_adapters: int = 2) -> AdapterAgent:
    metrics = GuardMetrics(["interactive"])
    return AdapterAgent(LoraConfig(max_loras=2, max_lora_rank=8, max_adapters=max_adapters), served_model_name="base",
                        base_model="/m", upstream=_Upstream(), metrics=metrics,  # type: ignore[arg-type]
                        in_use=Counter(), engine_up=lambda: False, adapter_dir=Path("/nonexistent"))


def doc(*names: str) -> dict:
    return {"adapters": [{"name": n, "source": {"path": f"/a/{n}"}} for n in names]}


def test_put_stores_the_set_and_answers_at_once():
    a = agent()
    status, answer = a.desire(doc("x", "y"))
    assert status == 202 and [s["state"] for s in answer["adapters"]] == ["Fetching", "Fetching"]
    assert 'gpufleet_guard_adapter_state{adapter="x",state="Fetching"} 1.0' in a.metrics.render().decode()


def test_put_refuses_more_than_max_adapters_naming_the_field():
    status, answer = agent(max_adapters=1).desire(doc("x", "y"))
    assert status == 422 and answer["error"]["param"] == "adapters" and "maxAdapters" in answer["error"]["message"]


@pytest.mark.parametrize("body,param", [
    ({"adapters": [{"name": "base", "source": {"path": "/a"}}]}, "adapters[0].name"),
    ({"adapters": [{"name": "../x", "source": {"path": "/a"}}]}, "adapters[0].name"),
    ({"adapters": [{"name": "x", "source": {}}]}, "adapters[0].source")])
def test_put_refuses_a_bad_set(body, param):
    status, answer = agent().desire(body)
    assert status == 422 and answer["error"]["param"] == param


def test_lora_off_answers_409():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gpufleet_engine.serving import adapters

    async def run():
        app = web.Application()
        adapters.register(app, None)
        async with TestClient(TestServer(app)) as client:
            put = await client.put("/adapters", json=doc("x"))
            got = await client.get("/adapters")
            return put.status, await put.json(), await got.json()
    status, answer, report = asyncio.run(run())
    assert status == 409 and "spec.engine.lora" in answer["error"]["message"]
    assert report["maxAdapters"] == 0 and report["adapters"] == []


def test_a_request_for_an_adapter_not_loaded_here_is_a_404_in_vllms_shape():
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "guard.json"
    admission = Admission(guard_config.parse(json.loads(fixture.read_text())))
    admission.tokenizer_loaded(_Tokenizer(), None)
    admission.adapter_served = {"loaded"}.__contains__
    assert admission.prepare("/v1/completions", {"model": "loaded", "prompt": "hi"}).adapter == "loaded"
    assert admission.prepare("/v1/completions", {"model": "chat", "prompt": "hi"}).adapter is None
    with pytest.raises(Rejection) as e:
        admission.prepare("/v1/completions", {"model": "elsewhere", "prompt": "hi"})
    assert e.value.status == 404 and e.value.param == "model"
    assert e.value.message.startswith("The model `elsewhere` does not exist.")


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def chat_token_count(self, messages, **kwargs) -> int:
        return 8


async def test_a_hub_adapter_downloads_although_the_pod_runs_offline(tmp_path, monkeypatch):
    """The engine pod sets HF_HUB_OFFLINE=1 for the base model; an adapter from the Hub (here a local
    stand-in of its HTTP API, as a mirror would be named with HF_ENDPOINT) still downloads."""
    from tests.support.fake_hub import FakeHub
    source = tmp_path / "source"
    adapter(source)
    hub = FakeHub.from_folder(source)
    url = await hub.start()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    try:
        spec = AdapterSpec("h", AdapterSource(hugging_face=HuggingFaceAdapterSource("org/a", "v1")))
        got = await asyncio.to_thread(adapter_fetch.fetch, spec, tmp_path / "dir")
    finally:
        await hub.stop()
    assert (got / "adapter_config.json").read_bytes() == (source / "adapter_config.json").read_bytes()
    assert any("/resolve/" in p for p in hub.requested)


def test_each_reported_adapter_carries_the_digest_of_the_source_it_holds():
    from gpufleet_api.guard.adapters import spec_digest

    a = agent()
    wanted = typed.convert(AdapterSet, doc("x", "y"))
    assert a.desire(typed.to_builtins(wanted))[0] == 202
    assert {s.name: s.digest for s in a.report().adapters} == {s.name: spec_digest(s) for s in wanted.adapters}
    # The same name from another source: the report says so at once (it is fetched anew).
    swapped = {"adapters": [{"name": "x", "source": {"uri": "https://elsewhere.example/x.tar"}}]}
    assert a.desire(swapped)[0] == 202
    (x,) = [s for s in a.report().adapters if s.name == "x"]
    assert x.digest == spec_digest(typed.convert(AdapterSet, swapped).adapters[0]) and x.state == "Fetching"
