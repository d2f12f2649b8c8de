"""vLLM 0.32 refuses to start a KV connector beside PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(VllmConfig._verify_kv_transfer_compat). The allocator setting the operator renders for each pool
with a connector, and the connector it renders, go through that check of the installed vLLM, in
a process of its own (importing vLLM takes seconds and sets process-wide state)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from gpufleet.manifests import children, names, pools
from gpufleet_api import parse_spec
from gpufleet_api.guard import guard_config
from gpufleet_engine.launch.flags import vllm_launch

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
SHARED = {"connector": "SharedStorage", "sharedStorage": {"hostPath": {"path": "/var/lib/kv"}}}
SPECS = {
    "pd-nixl": {"disaggregation": {}, "engine": {"kvTransfer": {"connector": "Nixl"}}},
    "pd-shared-cpu": {"disaggregation": {}, "engine": {"runtime": "vllm-cpu", "kvCache": {"blockSize": 32},
                                                       "kvTransfer": SHARED}},
    "kv-tier-lmcache": {"engine": {"kvTier": "Shared", "kvTransfer": {"connector": "LMCache"},
                                   "cudaAllocatorConfig": "expandable_segments:True,max_split_size_mb:512"}},
}
CHECK = """
import json, os, sys, types
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
verdicts = {}
for name, (env, kv) in json.loads(sys.stdin.read()).items():
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if env is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env
    stub = types.SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv), model_config=None)
    try:
        VllmConfig._verify_kv_transfer_compat(stub)
        verdicts[name] = "accepted"
    except ValueError as e:
        verdicts[name] = str(e)
print(json.dumps(verdicts))
"""


def rendered() -> dict[str, tuple[str | None, dict]]:
    """(PYTORCH_CUDA_ALLOC_CONF, --kv-transfer-config) of every pool of every spec, as the pod has them."""
    out = {}
    for name, over in SPECS.items():
        spec = parse_spec({"model": {"name": "m"}, **over})
        cm, hashes = children.build_configmap(ISVC, spec)
        for pool in pools.pools(spec):
            dep = children.build_deployment(ISVC, pool.spec, 1, hashes[pool.role], pool.role)
            vllm = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
            env = next((e["value"] for e in vllm["env"] if e["name"] == "PYTORCH_CUDA_ALLOC_CONF"), None)
            engine = guard_config.parse(json.loads(cm["data"][names.guard_config_key(pool.role)])).engine
            assert engine is not None
            argv = list(vllm_launch(engine).argv)
            out[f"{name}/{pool.role}"] = (env, json.loads(argv[argv.index("--kv-transfer-config") + 1]))
    return out


def test_vllm_takes_the_allocator_setting_the_operator_renders_beside_each_connector():
    cases = rendered()
    # The check bites: the operator's default allocator setting beside a connector is refused.
    cases["control/expandable-segments"] = ("expandable_segments:True", next(iter(cases.values()))[1])
    result = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(cases), capture_output=True, text=True,
                            timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu",
                                              "VLLM_LOGGING_LEVEL": "ERROR"})
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = json.loads(result.stdout.strip().splitlines()[-1])
    control = verdicts.pop("control/expandable-segments")
    assert "incompatible with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in control
    assert verdicts == {name: "accepted" for name in verdicts} and len(verdicts) == 5
    assert cases["kv-tier-lmcache/unified"][0] == "max_split_size_mb:512"  # the spec's other options stay
