"""Tracing from the spec and the chart to the guard and vLLM: spec.observability.tracing and the
operator's --otlp-endpoint into guard.json, guard.json's tracing into vLLM's --otlp-traces-endpoint,
and an image whose vLLM cannot export refused naming the field."""
from __future__ import annotations

import json

import pytest

from gpufleet.cli.run import settings_from_flags
from gpufleet.manifests import children, guard_config
from gpufleet_api import parse_spec
from gpufleet_api import tracing as names
from gpufleet_api.guard import guard_config as contract
from gpufleet_api.tracing import TracingConfig
from gpufleet_engine.launch import entrypoint
from gpufleet_engine.launch.flags import vllm_launch
from gpufleet_kit import tracing as kit

ISVC = {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1", "generation": 3}}


def spec(**over):
    return parse_spec({"model": {"name": "org/m"}, **over})


def built(s, endpoint="http://jaeger:4318"):
    cm, hashes = children.build_configmap(ISVC, s, otlp_endpoint=endpoint)
    return contract.parse(json.loads(cm["data"]["guard.json"])), hashes["unified"]


def test_the_fleets_endpoint_and_the_specs_sampling_reach_guard_json():
    config, _ = built(spec(observability={"tracing": {"sampledPerMille": 250, "engineSpans": "On"}}))
    assert config.tracing == TracingConfig("http://jaeger:4318", sample_ratio=0.25, engine_spans=True)


def test_the_default_is_one_in_a_hundred_without_vllms_spans():
    config, _ = built(spec())
    assert config.tracing == TracingConfig("http://jaeger:4318", sample_ratio=0.01, engine_spans=False)


def test_no_endpoint_or_tracing_off_renders_none_and_leaves_the_pods_hash_as_before():
    off, off_hash = built(spec(observability={"tracing": {"mode": "Off"}}))
    none, none_hash = built(spec(), endpoint="")
    assert off.tracing is None and none.tracing is None
    # Without tracing the pods' hash is what it was before tracing existed: no pod rolls.
    assert off_hash == none_hash == guard_config.config_hash(guard_config.build_guard_config("chat", "ml", spec()))


def test_the_operator_flag_becomes_its_setting():
    from click.testing import CliRunner

    from gpufleet.cli.run import run
    assert "--otlp-endpoint" in CliRunner().invoke(run, ["--help"]).output
    assert settings_from_flags.__kwdefaults__["otlp_endpoint"] == ""


def test_engine_spans_give_vllm_the_traces_endpoint_and_protocol():
    engine = contract.EngineConfig(model="org/m")
    plain = vllm_launch(engine)
    assert "--otlp-traces-endpoint" not in plain.argv
    http = vllm_launch(engine, tracing=TracingConfig("http://jaeger:4318", engine_spans=True))
    assert http.argv[http.argv.index("--otlp-traces-endpoint") + 1] == "http://jaeger:4318/v1/traces"
    assert http.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    grpc = vllm_launch(engine, tracing=TracingConfig("jaeger:4317", protocol="grpc", engine_spans=True))
    assert grpc.argv[grpc.argv.index("--otlp-traces-endpoint") + 1] == "jaeger:4317"
    guard_only = vllm_launch(engine, tracing=TracingConfig("http://jaeger:4318"))
    assert "--otlp-traces-endpoint" not in guard_only.argv


def test_vllm_traces_only_what_a_sampled_parent_asks_for(monkeypatch):
    """vLLM 0.32's TracerProvider takes its sampler from the environment: with flags.py's, a request without a
    traceparent (vLLM would start a root) and one under an unsampled parent record nothing; a sampled parent's
    child records, under the service name the trace store shows."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    launch = vllm_launch(contract.EngineConfig(model="org/m"),
                         tracing=TracingConfig("http://jaeger:4318", engine_spans=True))
    for key, value in launch.env.items():
        monkeypatch.setenv(key, value)
    provider = TracerProvider(resource=Resource.create({}))   # as vLLM's init_otel_tracer builds it
    tracer = provider.get_tracer("vllm")
    assert provider.resource.attributes["service.name"] == names.ENGINE_SERVICE_NAME

    def recorded(traceparent: str | None) -> bool:
        context = TraceContextTextMapPropagator().extract({"traceparent": traceparent} if traceparent else {})
        return tracer.start_span(names.ENGINE_REQUEST_SPAN, context=context).is_recording()

    assert not recorded(None)
    assert not recorded("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    assert recorded("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


def test_an_image_whose_vllm_cannot_export_is_refused_naming_the_field(tmp_path, monkeypatch):
    path = tmp_path / "guard.json"
    path.write_text(json.dumps({"servedModelName": "m", "tokenizer": "t", "engine": {"model": "org/m"},
                                "tracing": {"endpoint": "http://jaeger:4318", "engineSpans": True}}))
    monkeypatch.setattr(entrypoint, "otlp_problem", lambda: "opentelemetry.sdk.trace does not import")
    monkeypatch.setattr(entrypoint.os, "execvpe", lambda *a: pytest.fail("vLLM was started"))
    with pytest.raises(contract.ConfigError, match=r"spec\.observability\.tracing\.engineSpans"):
        entrypoint.exec_vllm(str(path))


def test_the_otlp_exporters_import_here():
    # xds-protos ships an old copy of opentelemetry-proto's modules at the same paths (scripts/setup.sh).
    assert kit.otlp_problem() is None
