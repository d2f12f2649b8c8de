"""The metric catalog (docs/metrics.md) is exactly what the code exports, so
dashboards and alerts (which may only use catalogued names) use real names."""
from gpufleet.metrics import OperatorMetrics
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_router.metrics import RouterMetrics
from tests.unit.observability.assets import catalog


def exported(registry) -> dict[str, str]:
    out = {}
    for fam in registry.collect():
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam.type
    return out


def test_catalog_matches_the_code():
    code = {**exported(OperatorMetrics().registry), **exported(GuardMetrics(["interactive"]).registry),
            **exported(RouterMetrics().registry)}
    documented = {n: t for n, t in catalog().items() if n.startswith("gpufleet_")}
    assert set(documented) - set(code) == set(), "documented but not exported"
    assert set(code) - set(documented) == set(), "exported but not in docs/metrics.md"
    for name, kind in code.items():
        assert documented[name] == kind, f"{name}: code says {kind}, docs say {documented[name]}"
