"""bench/status_writes.py's pure parts: the nodes it registers hold one replica of each busy service,
and those services cannot scale (every status write left is a figure's or a condition's). The
measurement itself needs the cluster and runs as a benchmark (bench/README.md)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kubernetes.utils import parse_quantity

from gpufleet.manifests.children import build_deployment
from gpufleet_api import parse_spec

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "status_writes.py"


def _load():
    spec = importlib.util.spec_from_file_location("status_writes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_the_bench_nodes_hold_one_replica_of_every_service():
    n = 1000
    nodes = bench.bench_nodes(n)
    obj = bench.service(7, "ns")
    obj["metadata"]["uid"] = "u-7"
    spec = parse_spec(obj["spec"])
    assert (spec.autoscaling.min_replicas, spec.autoscaling.max_replicas) == (1, 1)
    pod = build_deployment(obj, spec, 1, "h")["spec"]["template"]
    assert pod["spec"]["nodeSelector"]["gpufleet.dev/node-pool"] == bench.POOL
    # What the scheduler counts: the containers' requests, or an init container's if larger, plus overhead.
    def requests_of(containers):
        out: dict[str, float] = {}
        for c in containers:
            for k, v in (c.get("resources", {}).get("requests") or {}).items():
                out[k] = out.get(k, 0) + float(parse_quantity(v))
        return out
    requests = requests_of(pod["spec"]["containers"])
    for init in pod["spec"].get("initContainers", []):
        for k, v in requests_of([init]).items():
            requests[k] = max(requests.get(k, 0), v)
    for k, v in (pod["spec"].get("overhead") or {}).items():
        requests[k] = requests.get(k, 0) + float(parse_quantity(v))
    per_node = min(float(parse_quantity(nodes[0]["status"]["allocatable"][k])) // v
                   for k, v in requests.items() if v)
    per_node = min(per_node, int(nodes[0]["status"]["allocatable"]["pods"]))
    assert per_node * len(nodes) >= n, (requests, per_node)
    assert all(node["metadata"]["labels"]["gpufleet.dev/node-pool"] == bench.POOL for node in nodes)
