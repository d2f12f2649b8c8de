"""The informer against a scripted API server: LIST, then WATCH from the list's version with
bookmarks; a watch the server ends is reopened from the last version without a LIST; 410 Gone
(answer or ERROR event) lists again at once; a lost connection is reopened after a growing pause;
a kind not served is empty; a refused watch falls back to listing, saying what to grant."""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from gpufleet_kit.backoff import Backoff
from gpufleet_kit.kube.errors import ApiError, Forbidden, NotFound
from gpufleet_kit.kube.informer import Informer
from tests.support.waiting import wait_for


def pod(name: str, rv: str, ready: bool = False) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ml", "resourceVersion": rv},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


class ScriptedKube:
    """Answers each LIST and each WATCH with the next of its script: a LIST with (items, version) or an
    exception; a WATCH with a list of events, where an exception in the list is raised at that point.
    Once the scripts are used up, a call waits forever (the informer is cancelled by the test)."""

    def __init__(self, lists: list, watches: list):
        self.lists, self.watches = list(lists), list(watches)
        self.list_calls: list[dict] = []
        self.watch_calls: list[dict] = []
        self.closed = 0    # watch streams closed by the informer

    async def list_versioned(self, api_version, kind, namespace=None, *, label_selector=None, field_selector=None):
        self.list_calls.append({"namespace": namespace, "label_selector": label_selector})
        if not self.lists:
            await asyncio.Event().wait()
        answer = self.lists.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def watch(self, api_version, kind, namespace=None, *, timeout_seconds=60, label_selector=None,
                    field_selector=None, resource_version=None, allow_bookmarks=False):
        self.watch_calls.append({"resource_version": resource_version, "allow_bookmarks": allow_bookmarks,
                                 "label_selector": label_selector, "timeout_seconds": timeout_seconds})
        if not self.watches:
            await asyncio.Event().wait()
        script = self.watches.pop(0)
        if isinstance(script, BaseException):
            raise script
        try:
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.closed += 1


class Run:
    """An informer running in a task, with its pauses recorded instead of slept."""

    def __init__(self, kube: ScriptedKube, **options):
        self.pauses: list[float] = []
        self.changes = 0

        async def sleep(seconds: float) -> None:
            self.pauses.append(seconds)

        def changed() -> None:
            self.changes += 1

        self.informer = Informer(kube, "v1", "Pod", "ml", on_change=changed, sleep=sleep,
                                 backoff=Backoff(first=0.5, cap=4.0, jitter=0.2, rand=lambda: 0.5), **options)

    async def __aenter__(self) -> "Run":
        self.task = asyncio.create_task(self.informer.run())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task

    def names(self) -> list[str]:
        return sorted(o["metadata"]["name"] for o in self.informer.items())


async def until(predicate, what: str) -> None:
    async def check():
        return predicate()
    await wait_for(check, timeout=5, interval=0.005, what=what)


async def test_lists_then_watches_from_the_lists_version_applying_events_and_bookmarks():
    kube = ScriptedKube(
        lists=[([pod("a", "3")], "10")],
        watches=[[{"type": "ADDED", "object": pod("b", "11")},
                  {"type": "MODIFIED", "object": pod("a", "12", ready=True)},
                  {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "20"}}},
                  {"type": "DELETED", "object": pod("b", "21")}]])   # then the server ends it (its timeout)
    async with Run(kube, label_selector="app=engine") as run:
        await until(lambda: len(kube.watch_calls) == 2, "the watch reopened")
        assert run.names() == ["a"] and run.informer.items()[0]["status"]["conditions"][0]["status"] == "True"
        assert run.informer.synced.is_set()
        assert run.changes == 4 and run.informer.cache.version == 4   # the LIST and three changes
    assert kube.list_calls == [{"namespace": "ml", "label_selector": "app=engine"}]   # one LIST only
    first, second = kube.watch_calls
    assert first == {"resource_version": "10", "allow_bookmarks": True, "label_selector": "app=engine",
                     "timeout_seconds": run.informer.watch_seconds}
    assert second["resource_version"] == "21"   # resumed where the first ended, without a LIST
    assert run.pauses == []


async def test_a_bookmark_is_where_the_next_watch_resumes():
    kube = ScriptedKube(lists=[([pod("a", "3")], "10")],
                        watches=[[{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "99"}}}]])
    async with Run(kube) as run:
        await until(lambda: len(kube.watch_calls) == 2, "the watch reopened")
        assert run.changes == 1   # the LIST only: a bookmark changes nothing
    assert kube.watch_calls[1]["resource_version"] == "99"


@pytest.mark.parametrize("gone", [
    ApiError(410, "Expired", "too old resource version: 10 (55)"),               # the watch's answer
    [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}],
])
async def test_410_gone_lists_again_at_once(gone):
    kube = ScriptedKube(lists=[([pod("a", "3")], "10"), ([pod("a", "60", ready=True), pod("c", "58")], "61")],
                        watches=[gone])
    async with Run(kube) as run:
        await until(lambda: len(kube.watch_calls) == 2, "watching after the new LIST")
        assert run.names() == ["a", "c"]
    assert len(kube.list_calls) == 2 and kube.watch_calls[1]["resource_version"] == "61"
    assert run.pauses == []   # no pause: the version is gone, waiting does not bring it back


async def test_410_again_right_after_a_fresh_list_pauses_before_the_next():
    gone = ApiError(410, "Expired", "too old")
    kube = ScriptedKube(lists=[([], "10"), ([], "11"), ([], "12")], watches=[gone, gone])
    async with Run(kube):
        await until(lambda: len(kube.watch_calls) == 3, "watching after three LISTs")
    assert len(kube.list_calls) == 3


async def test_a_lost_connection_reconnects_from_the_last_version_after_a_growing_pause():
    lost = aiohttp.ClientPayloadError("connection reset")
    kube = ScriptedKube(
        lists=[([pod("a", "3")], "10")],
        watches=[[{"type": "ADDED", "object": pod("b", "11")}, lost],
                 aiohttp.ClientConnectionError("refused"),
                 asyncio.TimeoutError(),
                 [{"type": "MODIFIED", "object": pod("b", "14", ready=True)}, lost],
                 aiohttp.ClientConnectionError("refused")])
    async with Run(kube) as run:
        await until(lambda: len(kube.watch_calls) == 6, "the sixth watch")
        assert run.names() == ["a", "b"]
    assert len(kube.list_calls) == 1   # never re-listed: the version was still good
    assert [c["resource_version"] for c in kube.watch_calls] == ["10", "11", "11", "11", "14", "14"]
    # 0.5, 1, 2 while nothing came; an event resets it, so the next failures start again at 0.5
    assert run.pauses == [0.5, 1.0, 2.0, 0.5, 1.0]
    assert kube.closed == 2   # each broken stream was closed, not left to the garbage collector


async def test_a_kind_that_is_not_served_is_empty_and_listed_again_later():
    kube = ScriptedKube(lists=[([pod("a", "3")], "10"), NotFound(404, "NotFound", "kind Pod is not served"),
                               ([pod("z", "70")], "70")],
                        watches=[ApiError(404, "NotFound", "the server could not find the requested resource")])
    async with Run(kube) as run:
        await until(lambda: len(kube.watch_calls) == 2, "watching again")
        assert run.names() == ["z"]
    assert len(kube.list_calls) == 3 and run.pauses == [0.5, 1.0]


async def test_a_first_list_that_fails_says_it_tried_but_not_that_it_synced():
    kube = ScriptedKube(lists=[ApiError(500, "InternalError", "etcd")], watches=[])
    async with Run(kube) as run:
        await until(lambda: run.informer.tried.is_set(), "the first LIST tried")
        assert not run.informer.synced.is_set() and run.informer.items() == []


async def test_a_refused_watch_lists_again_at_the_backoffs_pace_and_says_what_to_grant(caplog):
    refused = Forbidden(403, "Forbidden", 'pods is forbidden: User "system:serviceaccount:gpufleet-system:'
                                          'gpufleet-router" cannot watch resource "pods" in API group ""')
    kube = ScriptedKube(lists=[([pod("a", "3")], "10"), ([pod("a", "5", ready=True)], "12"), ([], "13")],
                        watches=[refused, refused])
    with caplog.at_level(logging.ERROR, logger="gpufleet_kit.kube.informer"):
        async with Run(kube, refused_hint="grant watch, or run with --discovery list") as run:
            await until(lambda: len(kube.watch_calls) == 3, "the third watch")
            assert run.names() == []
    assert len(kube.list_calls) == 3 and run.pauses == [0.5, 1.0]
    assert "not permitted to watch" in caplog.text and "cannot watch resource" in caplog.text
    assert "or run with --discovery list" in caplog.text
