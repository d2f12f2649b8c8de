"""A namespaced install (the chart's rbac.scope Namespaced) grants no cluster-wide list of
InferenceServices: the cluster audits list them in each watched namespace, and only there."""
import pytest

from gpufleet.fleet.cluster_audit import ClusterAuditor, collect
from gpufleet.metrics import OperatorMetrics
from gpufleet.settings import OperatorSettings
from gpufleet.wiring.runtime import OperatorRuntime
from gpufleet_kit.kube.config import KubeConfig
from tests.unit.test_settings import KUBECONFIG


class Lister:
    """Answers as the API server does under Roles in ``granted`` only: a cluster-wide list of
    InferenceServices, or one elsewhere, is refused."""

    def __init__(self, granted=()):
        self.granted = set(granted)
        self.asked: list[tuple[str, str | None]] = []

    async def list(self, api_version, kind, namespace=None, *, label_selector=None, field_selector=None):
        self.asked.append((kind, namespace))
        if kind == "InferenceService":
            if self.granted and namespace not in self.granted:
                raise PermissionError(f"inferenceservices is forbidden in {namespace or 'the cluster'}")
            return [{"metadata": {"namespace": namespace or "any", "name": "chat"}, "spec": {}}]
        return []


async def test_the_services_are_listed_in_each_watched_namespace():
    lister = Lister(granted={"ml", "ops"})
    _, _, services = await collect(lister, ("ml", "ops"))
    assert sorted(s["metadata"]["namespace"] for s in services) == ["ml", "ops"]
    # Nodes and placed pods still across the cluster: the minimal read-only ClusterRole.
    assert ("Node", None) in lister.asked and ("Pod", None) in lister.asked


async def test_without_namespaces_the_services_are_listed_across_the_cluster():
    lister = Lister()
    await collect(lister)
    assert ("InferenceService", None) in lister.asked


async def test_the_auditor_lists_where_it_was_told():
    lister = Lister(granted={"ml"})
    auditor = ClusterAuditor(objects=lister, events=None, status=None, metrics=OperatorMetrics(), watched=set(),
                             namespaces=("ml",))
    await auditor.run_once()
    assert [a for a in lister.asked if a[0] == "InferenceService"] == [("InferenceService", "ml")]


@pytest.mark.parametrize("namespaces, listed", [
    ((), ()),                              # cluster-wide
    (("ml", "ops"), ("ml", "ops")),        # names: a namespaced install
    (("ml", "team-*"), ()),                # a pattern: the namespaces it matches are not known here
    (("!rn-*",), ()),
])
def test_the_namespaces_listed_one_by_one_are_the_watched_ones_when_each_is_a_name(namespaces, listed):
    assert OperatorSettings(namespaces=namespaces).listed_namespaces == listed


async def test_the_runtime_hands_the_auditor_the_watched_namespaces(tmp_path):
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    rt = OperatorRuntime(KubeConfig.from_file(str(path)), OperatorSettings(namespaces=("ml", "ops")))
    try:
        audit = rt._loops["cluster_audits"].__self__
        assert isinstance(audit, ClusterAuditor) and audit.namespaces == ("ml", "ops")
    finally:
        await rt.kube.close()
