"""vLLM's KV events from one source: the operator renders guard.json's ``engine.kvEvents`` wherever the prefix
cache is on, the guard checks it and renders vLLM's ``--kv-events-config`` from it, and the local runner turns
it on as the operator does."""
from __future__ import annotations

import json

import pytest

from gpufleet.manifests import guard_config as operator_guard_config
from gpufleet_api import parse_spec
from gpufleet_api.guard import kv_blocks
from gpufleet_api.guard.guard_config import ConfigError
from gpufleet_engine.launch.flags import vllm_launch
from gpufleet_engine.local.runner import LocalEngine
from tests.unit.engine.test_guard_flags import engine_cfg, flag


def test_kv_events_become_vllms_flag():
    cfg = engine_cfg(kvEvents={"endpoint": "ipc:///tmp/e.sock", "topic": "kv"})
    assert cfg.engine is not None
    argv = vllm_launch(cfg.engine, python="python3").argv
    assert json.loads(flag(argv, "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///tmp/e.sock", "topic": "kv"}
    without = engine_cfg()
    assert without.engine is not None and "--kv-events-config" not in vllm_launch(without.engine).argv


def test_kv_events_without_the_prefix_cache_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="engine.kvEvents: set, but enablePrefixCaching is false"):
        engine_cfg(kvEvents={}, enablePrefixCaching=False)


def test_a_kv_events_endpoint_that_is_not_zmqs_is_refused():
    with pytest.raises(ConfigError, match=r"engine.kvEvents.endpoint: 'http://x' is not a ZMQ"):
        engine_cfg(kvEvents={"endpoint": "http://x"})


def spec(**engine):
    return parse_spec({"model": {"name": "m"}, "engine": engine})


def test_the_operator_turns_the_events_on_wherever_the_prefix_cache_is():
    on = operator_guard_config.build_guard_config("chat", "ml", spec())
    assert on.engine is not None and on.engine.kv_events is not None
    assert on.engine.kv_events.endpoint == kv_blocks.KV_EVENTS_ENDPOINT   # the guard binds the pod's loopback
    assert not kv_blocks.publisher_binds(kv_blocks.KV_EVENTS_ENDPOINT)
    off = operator_guard_config.build_guard_config("chat", "ml", spec(prefixCaching="Disabled"))
    assert off.engine is not None and off.engine.kv_events is None


def test_the_local_runner_turns_them_on_over_a_socket_file(tmp_path):
    engine = LocalEngine("tiny", work_dir=tmp_path)
    assert engine.config.engine is not None and engine.config.engine.kv_events is not None
    assert engine.config.engine.kv_events.endpoint == f"ipc://{tmp_path}/kv-events.sock"
    off = LocalEngine("tiny", work_dir=tmp_path, guard={"engine": {"kvEvents": None}})
    assert off.config.engine is not None and off.config.engine.kv_events is None
