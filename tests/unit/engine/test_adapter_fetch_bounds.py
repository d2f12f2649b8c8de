"""Adapter sources are untrusted input (issue 44): each test tries to cross a bound of the guard's
adapter fetch and fails. Real HTTP servers on 127.0.0.1, real tar archives; the loopback servers
are reachable only with ``allowPrivateSources`` on, and refused without it."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import tarfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import aiohttp
import pytest

from gpufleet_api import redact
from gpufleet_api.guard.adapters import AdapterSource, AdapterSpec, HuggingFaceAdapterSource
from gpufleet_api.guard.guard_config import AdapterFetchConfig, LoraConfig
from gpufleet_engine.serving import adapter_fetch
from gpufleet_engine.serving.adapter_check import AdapterProblem
from gpufleet_engine.serving.adapters import AdapterAgent
from gpufleet_engine.serving.prometheus import GuardMetrics
from tests.support.file_server import FileServer as Server

MiB = 1 << 20
ALLOW = AdapterFetchConfig(allow_private_sources=True)
FILES = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w"}


def tar_bytes(files: dict[str, bytes], *, gz: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def uri_spec(uri: str, name: str = "x") -> AdapterSpec:
    return AdapterSpec(name, AdapterSource(uri=uri))


def problem(call: Callable[[], object]) -> AdapterProblem:
    with pytest.raises(AdapterProblem) as e:
        call()
    return e.value


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@pytest.fixture
def written(monkeypatch) -> list[int]:
    """The bytes in each fetch folder just before it is removed (a failed fetch's partial folder)."""
    sizes: list[int] = []
    real = shutil.rmtree

    def spy(path, *args, **kwargs):
        if Path(path).name.startswith(".x-"):
            sizes.append(du(Path(path)))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", spy)
    return sizes


# --- the positive case and the address rule ------------------------------------------------------------

def test_an_archive_over_http_is_extracted_when_private_sources_are_allowed(tmp_path, server):
    uri = server.body("/a.tar.gz", tar_bytes(FILES, gz=True))
    got = adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir", limits=ALLOW)
    assert (got / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert oct((got / "adapter_config.json").stat().st_mode & 0o777) == oct(0o644)
    plain = server.body("/b.tar", tar_bytes(FILES, gz=False))
    assert (adapter_fetch.fetch(uri_spec(plain), tmp_path / "dir", limits=ALLOW) / "adapter_model.safetensors").exists()


def test_the_same_loopback_server_is_refused_by_default(tmp_path, server):
    uri = server.body("/a.tar.gz", tar_bytes(FILES))
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir"))
    assert p.reason == "MissingFiles" and "127.0.0.1, a loopback address" in p.message
    assert "allowPrivateSources" in p.message
    assert not (tmp_path / "dir" / "x").exists() and list((tmp_path / "dir").iterdir()) == []


@pytest.mark.parametrize("uri,kind", [
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[fe80::1]/a.tgz", "link-local"),
    ("http://127.0.0.1:9/a.tgz", "loopback"),
    ("http://[::1]/a.tgz", "loopback"),
    ("http://10.1.2.3/a.tgz", "private"),
    ("http://172.16.0.1/a.tgz", "private"),
    ("http://192.168.1.1/a.tgz", "private"),
    ("http://100.64.0.1/a.tgz", "private"),
    ("http://[fd00::1]/a.tgz", "private"),
    ("http://[::ffff:10.0.0.1]/a.tgz", "private"),
    ("http://0.0.0.0/a.tgz", "unspecified"),
    ("http://[::]/a.tgz", "unspecified"),
    ("http://224.0.0.1/a.tgz", "multicast"),
])
def test_internal_addresses_are_refused_before_any_connection(tmp_path, monkeypatch, uri, kind):
    def no_connection(*args, **kwargs):
        raise AssertionError("connected to a refused address")
    monkeypatch.setattr(adapter_fetch.socket, "create_connection", no_connection)
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path))
    assert p.reason == "MissingFiles" and f"a {kind} address" in p.message, p.message
    assert "answered HTTP" not in p.message


def test_every_address_a_name_resolves_to_is_checked(tmp_path, monkeypatch):
    def resolve(host, port, *args, **kwargs):
        assert host == "adapters.example.com"
        return [(2, 1, 6, "", ("93.184.216.34", port)), (2, 1, 6, "", ("169.254.169.254", port))]
    monkeypatch.setattr(adapter_fetch.socket, "getaddrinfo", resolve)
    p = problem(lambda: adapter_fetch.fetch(uri_spec("https://adapters.example.com/a.tgz"), tmp_path))
    assert "169.254.169.254, a link-local address" in p.message


def test_the_connection_goes_to_the_checked_address_with_the_uris_host(tmp_path, server, monkeypatch):
    """A name is resolved once: the socket connects to the address that was checked (no second lookup
    a rebinding DNS server could answer differently), and the Host header is the URI's."""
    hosts: list[str] = []

    def route(h):
        hosts.append(h.headers["Host"])
        data = tar_bytes(FILES)
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    server.routes["/a.tgz"] = route
    port = server.httpd.server_address[1]
    answers = iter([[(2, 1, 6, "", ("127.0.0.1", port))]])  # the name resolves once, then never again
    real = adapter_fetch.socket.getaddrinfo
    monkeypatch.setattr(adapter_fetch.socket, "getaddrinfo",
                        lambda host, *a, **k: next(answers) if host == "adapters.example.com" else real(host, *a, **k))
    got = adapter_fetch.fetch(uri_spec(f"http://adapters.example.com:{port}/a.tgz"), tmp_path, limits=ALLOW)
    assert (got / "adapter_config.json").exists() and hosts == [f"adapters.example.com:{port}"]


def test_a_file_uri_is_refused_naming_the_field_and_the_fix(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes(FILES, gz=False))
    p = problem(lambda: adapter_fetch.fetch(uri_spec((tmp_path / "a.tar").as_uri()), tmp_path / "dir", limits=ALLOW))
    assert p.reason == "MissingFiles" and "spec.source.uri" in p.message and "file://" in p.message
    assert "spec.source.pvc" in p.message and "spec.source.path" in p.message
    assert not (tmp_path / "dir" / "x").exists()


# --- redirects -------------------------------------------------------------------------------------

def test_a_redirect_of_the_same_scheme_to_an_allowed_address_is_followed(tmp_path, server):
    server.body("/real.tgz", tar_bytes(FILES))
    uri = server.redirect("/moved.tgz", "/real.tgz")
    assert (adapter_fetch.fetch(uri_spec(uri), tmp_path, limits=ALLOW) / "adapter_config.json").exists()


def test_a_redirect_that_changes_the_scheme_is_refused(tmp_path, server):
    port = server.httpd.server_address[1]
    uri = server.redirect("/a.tgz", f"https://127.0.0.1:{port}/a.tgz")
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path, limits=ALLOW))
    assert "may not change the scheme (http to https)" in p.message
    back = server.redirect("/b.tgz", "ftp://127.0.0.1/b.tgz")
    assert "may not change the scheme" in problem(lambda: adapter_fetch.fetch(uri_spec(back), tmp_path,
                                                                              limits=ALLOW)).message


@pytest.mark.parametrize("location,kind", [("http://169.254.169.254/latest/meta-data/", "link-local"),
                                           ("http://10.0.0.1/a.tgz", "private")])
def test_a_redirect_to_a_refused_address_is_refused(tmp_path, server, monkeypatch, location, kind):
    # The test server stands in for a public one: its loopback address passes the check, nothing else does.
    real = adapter_fetch.refused_kind
    monkeypatch.setattr(adapter_fetch, "refused_kind", lambda ip: None if str(ip) == "127.0.0.1" else real(ip))
    uri = server.redirect("/a.tgz", location)
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path))
    assert p.reason == "MissingFiles" and f"a {kind} address" in p.message


def test_a_redirect_loop_ends(tmp_path, server):
    uri = server.redirect("/loop", "/loop")
    assert "redirects more than" in problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path, limits=ALLOW)).message


# --- bytes, members and the deadline -------------------------------------------------------------------

def endless_tar(member_bytes: int, total: int) -> Callable[[], Iterator[bytes]]:
    """An uncompressed tar of ``total`` bytes of zeros in members of ``member_bytes``, generated as it
    is sent (the test never holds or writes a GiB)."""
    def chunks() -> Iterator[bytes]:
        zeros = bytes(MiB)
        for i in range(total // member_bytes):
            info = tarfile.TarInfo(f"part-{i}.bin")
            info.size = member_bytes
            yield info.tobuf()
            for _ in range(member_bytes // MiB):
                yield zeros
    return chunks


def test_a_gib_tar_bomb_fails_as_too_large_having_written_under_twice_the_cap(tmp_path, server, written):
    cap = 8 * MiB
    uri = server.stream("/bomb.tar", endless_tar(MiB, 1 << 30))
    started = time.monotonic()
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir",
                                            limits=AdapterFetchConfig(max_bytes=cap, allow_private_sources=True)))
    assert p.reason == "MissingFiles" and "too large" in p.message and str(cap) in p.message
    assert written and max(written) < 2 * cap
    assert list((tmp_path / "dir").iterdir()) == []          # the partial folder is gone
    assert server.sent < 1 << 30 and time.monotonic() - started < 30


def test_a_declared_size_over_the_cap_is_refused_before_anything_is_read(tmp_path, server):
    def huge(h):
        h.send_response(200)
        h.send_header("Content-Length", str(1 << 30))
        h.end_headers()
    server.routes["/huge.tgz"] = huge
    p = problem(lambda: adapter_fetch.fetch(uri_spec(server.url + "/huge.tgz"), tmp_path,
                                            limits=AdapterFetchConfig(max_bytes=MiB, allow_private_sources=True)))
    assert "too large" in p.message and "1073741824 bytes" in p.message


class _Zeros(io.RawIOBase):
    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def test_a_gzip_bomb_fails_on_its_extracted_size_without_writing_it(tmp_path, server, written):
    """A few hundred KiB downloaded that would extract to 64 MiB: refused at the member's header."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 64 * MiB
        tar.addfile(info, io.BufferedReader(_Zeros(info.size)))
    assert len(buf.getvalue()) < MiB
    uri = server.body("/bomb.tgz", buf.getvalue())
    cap = 2 * MiB
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir",
                                            limits=AdapterFetchConfig(max_bytes=cap, allow_private_sources=True)))
    assert "extracted files is too large" in p.message
    assert written and max(written) < 2 * cap


def test_too_many_members_are_refused(tmp_path, server):
    uri = server.body("/many.tgz", tar_bytes({f"f{i}": b"" for i in range(50)} | FILES))
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir",
                                            limits=AdapterFetchConfig(max_members=20, allow_private_sources=True)))
    assert "too many files: over 20" in p.message and list((tmp_path / "dir").iterdir()) == []


def test_one_deadline_bounds_the_whole_fetch_not_each_read(tmp_path, server):
    data = tar_bytes(FILES, gz=False)

    def trickle() -> Iterator[bytes]:
        for i in range(len(data)):
            time.sleep(0.02)      # each read is quick; the whole would take 200 s
            yield data[i:i + 1]
    uri = server.stream("/slow.tar", trickle)
    started = time.monotonic()
    p = problem(lambda: adapter_fetch.fetch(uri_spec(uri), tmp_path / "dir",
                                            limits=AdapterFetchConfig(fetch_timeout_seconds=1,
                                                                      allow_private_sources=True)))
    assert p.reason == "SourceUnreachable" and "took longer than 1s" in p.message
    assert time.monotonic() - started < 5


def test_a_path_source_past_the_caps_is_refused(tmp_path):
    folder = tmp_path / "claim" / "a"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes(b'{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(2 * MiB))
    spec = AdapterSpec("a", AdapterSource(path=str(folder)))
    assert adapter_fetch.fetch(spec, tmp_path / "dir") == folder
    assert "too large" in problem(lambda: adapter_fetch.fetch(spec, tmp_path / "dir",
                                                              limits=AdapterFetchConfig(max_bytes=MiB))).message
    assert "too many files" in problem(lambda: adapter_fetch.fetch(spec, tmp_path / "dir",
                                                                   limits=AdapterFetchConfig(max_members=1))).message


def test_a_hub_download_past_the_cap_is_too_large(tmp_path):
    def download(repo_id, revision, local_dir):
        Path(local_dir).mkdir(parents=True)
        (Path(local_dir) / "adapter_model.safetensors").write_bytes(bytes(2 * MiB))
        return local_dir
    hub = AdapterSpec("h", AdapterSource(hugging_face=HuggingFaceAdapterSource("org/a", "v1")))
    p = problem(lambda: adapter_fetch.fetch(hub, tmp_path, download=download, limits=AdapterFetchConfig(max_bytes=MiB)))
    assert "org/a@v1 from the Hub is too large" in p.message and not (tmp_path / "h").exists()


async def test_a_hub_download_is_stopped_once_it_passes_the_cap(tmp_path, monkeypatch):
    """The child process downloading from the Hub (a local stand-in of its API) is stopped by size."""
    from tests.support.fake_hub import FakeHub
    source = tmp_path / "source"
    source.mkdir()
    (source / "adapter_config.json").write_bytes(b'{"r": 8}')
    (source / "adapter_model.safetensors").write_bytes(os.urandom(4 * MiB))
    hub = FakeHub.from_folder(source)
    url = await hub.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    try:
        spec = AdapterSpec("h", AdapterSource(hugging_face=HuggingFaceAdapterSource("org/a", "v1")))
        with pytest.raises(AdapterProblem) as e:
            await asyncio.to_thread(adapter_fetch.fetch, spec, tmp_path / "dir",
                                    limits=AdapterFetchConfig(max_bytes=MiB))
    finally:
        await hub.stop()
    assert "too large" in e.value.message and not (tmp_path / "dir" / "h").exists()


# --- redaction -------------------------------------------------------------------------------------

def test_redaction_drops_credentials_query_and_fragment():
    assert redact.uri("https://bucket.s3/x.tgz?X-Amz-Signature=abc&X-Amz-Credential=k") == \
        "https://bucket.s3/x.tgz?<redacted>"
    assert redact.uri("https://user:token@host:8443/a.tgz#frag") == "https://host:8443/a.tgz"
    assert redact.uri("http://[::1]:80/a") == "http://[::1]:80/a"
    assert redact.text("cannot read 'https://u:p@h/x?sig=1': 403; see http://h/y#z") == \
        "cannot read 'https://h/x?<redacted>': 403; see http://h/y"


async def test_a_presigned_uri_never_shows_its_signature(tmp_path, server, caplog):
    secret, password = "SIGNATURE-0123456789abcdef", "PASSWORD-s3cr3t"
    server.body("/x.tgz", b"denied", status=403)
    port = server.httpd.server_address[1]
    uri = f"http://user:{password}@127.0.0.1:{port}/x.tgz?X-Amz-Signature={secret}&X-Amz-Expires=60"
    agent = AdapterAgent(LoraConfig(max_loras=2, max_lora_rank=8, max_adapters=4), served_model_name="base",
                         base_model="/m", upstream=None, metrics=GuardMetrics(["interactive"]),  # type: ignore[arg-type]
                         in_use=Counter(), engine_up=lambda: False, adapter_dir=tmp_path, fetch_limits=ALLOW)
    status, _ = agent.desire({"adapters": [{"name": "x", "source": {"uri": uri}}]})
    assert status == 202
    with caplog.at_level(logging.DEBUG):
        await agent.reconcile()
    state = agent.report().adapters[0]
    assert state.state == "Failed" and state.reason == "SourceUnreachable" and "HTTP 403" in state.message
    assert f"127.0.0.1:{port}/x.tgz?<redacted>" in state.message
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gpufleet_engine.serving import adapters
    app = web.Application()
    adapters.register(app, agent)
    async with TestClient(TestServer(app)) as client:
        listed = await (await client.get("/adapters")).text()
    for shown in (state.message, caplog.text, listed, agent.metrics.render().decode()):
        assert secret not in shown and password not in shown
    assert "<redacted>" in caplog.text


# --- nested JSON ------------------------------------------------------------------------------------

async def test_a_deeply_nested_put_adapters_body_is_a_400_naming_the_problem(tmp_path):
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from gpufleet_engine.serving import adapters
    agent = AdapterAgent(LoraConfig(max_loras=2, max_lora_rank=8, max_adapters=4), served_model_name="base",
                         base_model="/m", upstream=None, metrics=GuardMetrics(["interactive"]),  # type: ignore[arg-type]
                         in_use=Counter(), engine_up=lambda: False, adapter_dir=tmp_path)
    app = web.Application()
    adapters.register(app, agent)
    async with TestClient(TestServer(app)) as client:
        deep = await client.put("/adapters", data=b"[" * 100_000, headers={"content-type": "application/json"})
        answer = await deep.json()
        nested = {"adapters": [{"name": "x", "source": {"path": "/a"}, "baseModel": None}]}
        ok = await client.put("/adapters", json=nested)
    assert deep.status == 400 and "JSON nested deeper than 64 levels" in answer["error"]["message"]
    assert ok.status == 202 and agent.book.names() == {"x"}


async def test_a_deeply_nested_request_body_is_a_400_not_a_500(guard_factory, fake_vllm):
    guard = await guard_factory()
    async with aiohttp.ClientSession() as s:
        for route in ("/v1/completions", "/v1/chat/completions"):
            for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}",
                         b'{"model": "m", "messages": [' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"]}"):
                async with s.post(guard.url + route, data=body, headers={"content-type": "application/json"}) as r:
                    assert r.status == 400, (route, r.status, await r.text())
                    message = (await r.json())["error"]["message"]
                    assert "JSON nested deeper than 64 levels" in message and "at most 64" in message
        async with s.post(guard.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2}) as r:
            assert r.status == 200


def test_the_bounded_parser_accepts_the_limit_and_refuses_one_more():
    from gpufleet_api import bounded_json
    assert bounded_json.loads(b"[" * 64 + b"]" * 64) is not None
    assert bounded_json.loads(json.dumps({"messages": [{"role": "user", "content": "[[[[" * 100}] * 200})) is not None
    for raw in (b"[" * 65 + b"]" * 65, "[" * 100_000, b'{"a":' * 2000 + b"1" + b"}" * 2000):
        with pytest.raises(bounded_json.TooDeep):
            bounded_json.loads(raw)
    with pytest.raises(ValueError):
        bounded_json.loads(b"{")
