"""The leader-election loop (``LeaderElector``) against a fake API server: a stop (SIGTERM) hands the Lease
over even when it cancels a renewal that the API server had already stored, so the Lease is at a newer
resourceVersion than the one the loop last saw (the release's PUT then conflicts)."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.leader_election.elector import LeaderElector
from gpufleet.leader_election.records import Timing
from gpufleet.metrics import OperatorMetrics
from gpufleet_kit.kube.config import KubeConfig
from tests.support.waiting import wait_for

NS, NAME = "ops", "gpufleet-operator"
GROUP = "/apis/coordination.k8s.io/v1"


class FakeLease:
    """One Lease behind resourceVersion preconditions. ``hold_next_update``: the next PUT is stored, then
    its answer waits (``landed`` set) until ``answer``."""

    def __init__(self):
        self.lease: dict | None = None
        self.rv = 0
        self.conflicts = 0
        self.landed = asyncio.Event()
        self._hold = False
        self._answer = asyncio.Event()

    def hold_next_update(self) -> None:
        self._hold = True

    def answer(self) -> None:
        self._answer.set()

    def _store(self, body: dict) -> dict:
        self.rv += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}
        return self.lease

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == GROUP:
            return web.json_response({"resources": [{"name": "leases", "kind": "Lease", "namespaced": True}]})
        if path.endswith("/events"):
            return web.json_response(await request.json(), status=201)
        if request.query.get("watch"):
            return web.Response(text="")  # a watch that ends at once: the loop's reads carry the election
        if request.method == "GET":
            if self.lease is None:
                return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
            return web.json_response(self.lease)
        body = json.loads(await request.read())
        if request.method == "POST":
            return web.json_response(self._store(body), status=201)
        if body["metadata"].get("resourceVersion") != str(self.rv):
            self.conflicts += 1
            return web.json_response({"kind": "Status", "code": 409, "reason": "Conflict",
                                      "message": "the object has been modified"}, status=409)
        stored = self._store(body)
        if self._hold:
            self._hold = False
            self.landed.set()
            await self._answer.wait()
        return web.json_response(stored)


async def test_a_stop_that_cancels_a_stored_renewal_still_releases_the_lease(tmp_path):
    fake = FakeLease()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    server = TestServer(app)
    await server.start_server()
    config = tmp_path / "kubeconfig"
    config.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{server.port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    elector = LeaderElector(KubeConfig.from_file(str(config)), NS, NAME, "op-a", Timing(3.0, 2.0, 0.5),
                            OperatorMetrics())
    try:
        await elector.start()
        await wait_for(elector.may_act, timeout=10, interval=0.05, what="op-a leading", describe=lambda: fake.lease)
        fake.hold_next_update()
        # The next renewal is stored; its answer has not reached the loop when the stop cancels it.
        await asyncio.wait_for(fake.landed.wait(), 10)
        await elector.stop()
    finally:
        fake.answer()
        await server.close()
    assert fake.lease is not None
    spec = fake.lease["spec"]
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1, \
        f"the Lease was not released: {fake.lease} ({fake.conflicts} conflicting writes)"
