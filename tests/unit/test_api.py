"""The API types: defaults, parsing errors, and the generated CRD."""
from pathlib import Path

import pytest
import yaml

from gpufleet_api import SpecError, parse_spec, to_api
from gpufleet_api.crd import build_crd, render_markdown, render_yaml

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_the_types():
    committed = (ROOT / "crds" / "inferenceservices.serving.gpufleet.dev.yaml").read_text()
    assert committed == render_yaml(), "crds/ drifted from the API types: run `gpufleet crd -o crds/...`"


def test_api_reference_matches_the_types():
    assert (ROOT / "docs" / "api.md").read_text() == render_markdown(), "run `gpufleet crd --markdown -o docs/api.md`"


def test_short_manifest_gets_every_default():
    spec = parse_spec(yaml.safe_load((ROOT / "samples" / "chat.yaml").read_text())["spec"])
    assert spec.resources.gpus_per_replica == 1
    assert spec.isolation.mode == "Dedicated"
    assert spec.admission.kv_watermark_percent == 5
    assert (spec.autoscaling.kv_high_watermark_percent, spec.autoscaling.kv_low_watermark_percent) == (80, 40)
    assert [c.name for c in spec.admission.queue_classes] == ["interactive", "standard", "background"]
    assert spec.audit.fragmentation.interval_seconds == 3600
    assert spec.audit.fragmentation.threshold_percent == 25


def test_every_sample_parses():
    from gpufleet_api import parse
    from gpufleet_api.v1alpha1 import InferenceAdapterSpec
    for f in (ROOT / "samples").glob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc.get("kind") == "InferenceService":
                parse_spec(doc["spec"])
            elif doc.get("kind") == "InferenceAdapter":
                parse(InferenceAdapterSpec, doc["spec"])


@pytest.mark.parametrize("spec, path", [
    ({}, "spec.model"),
    ({"model": {"name": "m"}, "autoscaling": {"minReplicas": "two"}}, "spec.autoscaling.minReplicas"),
    ({"model": {"name": "m"}, "isolation": {"mode": "Sometimes"}}, "spec.isolation.mode"),
    ({"model": {"name": "m"}, "admission": {"queueClasses": [{"name": "x", "level": 1}]}},
     "spec.admission.queueClasses[0].maxQueueSeconds"),
])
def test_parse_errors_name_the_field(spec, path):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert e.value.path == path


def test_round_trip_keeps_values():
    doc = yaml.safe_load((ROOT / "samples" / "full.yaml").read_text())["spec"]
    again = to_api(parse_spec(doc))
    assert again["engine"]["tensorParallelSize"] == 4
    assert again["model"]["source"]["huggingFace"]["credentialsSecretRef"] == {"name": "hf-token", "key": "token"}


def _walk(schema, path=""):
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_every_spec_field_has_a_description():
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [p for p, s in _walk(spec, "spec")
               if not s.get("description") and not (p.endswith("[]") and s.get("type") != "object")]
    assert not missing, f"fields without description (kubectl explain would be empty): {missing}"


def test_crd_has_status_and_scale_subresources_and_oncall_columns():
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    cols = [c["name"] for c in version["additionalPrinterColumns"]]
    for wanted in ("Ready", "Replicas", "KV%", "P99-TTFT(ms)", "Frag%", "Age"):
        assert wanted in cols


def test_the_field_reference_shows_list_defaults_and_every_status_field():
    doc = render_markdown()
    assert "`name: interactive, level: 1, maxQueueSeconds: 2`" in doc
    status = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    for name in status["properties"]:
        assert f"| `status.{name}` |" in doc, name


def test_the_planning_guide_states_the_apis_default_watermark():
    from gpufleet_api.v1alpha1 import AdmissionSpec
    planning = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    assert f"| `--kv-watermark-percent` | {AdmissionSpec().kv_watermark_percent} |" in planning
