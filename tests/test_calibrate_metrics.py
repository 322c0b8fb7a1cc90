"""Parsing vLLM's /metrics text: KV capacity from `cache_config_info`, and the load gauges."""

from __future__ import annotations

from simadmit.calibrate.metrics import parse_cache_config, parse_gauges

# Trimmed from a vLLM 0.32.0 CPU server's /metrics (SmolLM2-135M, 2 GiB KV cache), during a run at concurrency 3.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="capacity"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0123
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smollm2"} 4711.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="smollm2"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smollm2"} 4.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",kv_cache_dtype_skip_layers="[]",kv_cache_memory_bytes="2147483648",kv_cache_size_tokens="93184",num_cpu_blocks="None",num_gpu_blocks="728",num_gpu_blocks_override="None",sliding_window="None"} 1.0
"""


def test_kv_capacity_is_blocks_times_block_size() -> None:
    """KV capacity in tokens = num_gpu_blocks x block_size, read through the Prometheus text parser."""
    cache = parse_cache_config(METRICS)
    assert cache is not None
    assert (cache.num_blocks, cache.block_size, cache.engines) == (728, 128, 1)
    assert cache.capacity_tokens == 93184


def test_gauges() -> None:
    g = parse_gauges(METRICS)
    assert (g.running, g.waiting) == (3.0, 2.0)
    assert g.kv_usage == 0.0123


def test_server_without_cache_info() -> None:
    """A server that does not expose cache_config_info (not vLLM) gives None, not a crash."""
    assert parse_cache_config("# TYPE up gauge\nup 1.0\n") is None
    assert parse_gauges("# TYPE up gauge\nup 1.0\n").running == 0.0


def test_two_engines_sum_load_and_report_per_engine_capacity() -> None:
    """Behind a data-parallel endpoint, load adds up and the KV capacity stays that of one engine."""
    second = METRICS.replace('engine="0"', 'engine="1"').split("\n")
    both = METRICS + "\n".join(line for line in second if line.startswith("vllm:")) + "\n"
    assert parse_gauges(both).running == 6.0
    cache = parse_cache_config(both)
    assert cache is not None and cache.engines == 2 and cache.capacity_tokens == 93184
