"""`gpufleet plan`: size a service from its request log or its Prometheus metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys

import click
from click.core import ParameterSource

from gpufleet_api.v1alpha1 import AdmissionSpec, EngineSpec, SLOSpec

from ..planning.errors import PlanningError
from ..planning.planner import plan_from_log, plan_from_prometheus
from ..planning.profiles import ProfileSet, load_profile_file
from ..planning.report import render
from ..planning.requests import parse_request_log
from ..planning.sizing import DEFAULT_BANDWIDTH_EFFICIENCY, DEFAULT_MFU, Settings
from .prometheus import PrometheusClient, read_sample

# The plan assumes what a default InferenceService would run with.
_SLO, _ADMISSION, _ENGINE = SLOSpec(), AdmissionSpec(), EngineSpec()
_SPEC = "InferenceService default"

# Exit status when the plan is printed but an SLO cannot be met by adding replicas.
EXIT_SLO_UNREACHABLE = 3

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


class Duration(click.ParamType):
    """"90s", "5m", "1h30m", or plain seconds."""
    name = "duration"

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, (int, float)):
            seconds = float(value)
        else:
            text = str(value).strip()
            try:
                seconds = float(text)
            except ValueError:
                parts = _DURATION_PART.findall(text)
                if not parts or "".join(n + u for n, u in parts) != text:
                    self.fail(f"{value!r} is not a duration; write e.g. 90s, 5m, 1h or 1h30m", param, ctx)
                seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
        if seconds <= 0:
            self.fail(f"{value!r} must be longer than zero", param, ctx)
        return seconds


# option name → (Settings field or other key, where its default comes from)
_DEFAULT_SOURCES = {
    "gpu": ("gpu", "default of --gpu"),
    "model": ("model", "default of --model"),
    "ttft_p99_ms": ("ttft_p99_seconds", f"{_SPEC} spec.slo.ttftP99Milliseconds"),
    "itl_p99_ms": ("itl_p99_seconds", f"{_SPEC} spec.slo.itlP99Milliseconds"),
    "gpu_memory_utilization": ("gpu_memory_utilization", f"{_SPEC} spec.engine.gpuMemoryUtilizationPercent"),
    "kv_watermark_percent": ("kv_watermark_percent", f"{_SPEC} spec.admission.kvWatermarkPercent"),
    "max_num_seqs": ("max_num_seqs", f"{_SPEC} spec.engine.maxNumSeqs"),
    "max_concurrency": ("max_concurrency", f"{_SPEC} spec.admission.maxConcurrency"),
    "mfu": ("mfu", "planner default (vLLM prefill typically reaches 0.3-0.6 of peak FLOP/s)"),
    "bandwidth_efficiency": ("bandwidth_efficiency",
                             "planner default (decode typically reaches 0.6-0.8 of peak HBM bandwidth)"),
    "tensor_parallel": ("tensor_parallel", "--tensor-parallel"),
}


def _sources(ctx: click.Context) -> dict[str, str]:
    out = {}
    for option, (key, default_source) in _DEFAULT_SOURCES.items():
        given = ctx.get_parameter_source(option) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)
        out[key] = f"--{option.replace('_', '-')}" if given else default_source
    return out


@click.command()
@click.option("--log", "log_path", type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="Request log: JSONL with timestamp, prompt_tokens, output_tokens (or an OpenAI access log).")
@click.option("--format", "log_format", type=click.Choice(["auto", "jsonl", "openai"]), default="auto",
              show_default=True, help="Log format; auto decides from the first line with token counts.")
@click.option("--skip-invalid", is_flag=True,
              help="Skip malformed log lines (counted and reported) instead of stopping at the first.")
@click.option("--prometheus", "prometheus_url", metavar="URL",
              help="Read the distribution from this Prometheus (base URL) instead of a log.")
@click.option("--service", help="With --prometheus: the service label of the engines' metrics.")
@click.option("--namespace", help="With --prometheus: also match this namespace label.")
@click.option("--window", type=Duration(), default="1h", show_default=True,
              help="With --prometheus: how far back to look.")
@click.option("--rps-window", type=Duration(), default="60s", show_default=True,
              help="Rates (RPS, tokens/s) are measured per window of this length; peak and trough are over windows.")
@click.option("--gpu", default="H100-80GB", show_default=True, help="GPU profile (or nvidia.com/gpu.product).")
@click.option("--model", default="Llama-3.1-8B", show_default=True,
              help="Model profile; a Hugging Face id such as meta-llama/Llama-3.1-8B-Instruct also matches.")
@click.option("--profile-file", type=click.Path(exists=True, dir_okay=False),
              help="YAML with extra GPU/model profiles (see docs/planning.md).")
@click.option("--tensor-parallel", type=click.IntRange(1, 16),
              help="GPUs per replica. Default: the smallest of 1, 2, 4, 8 that serves a p99 request.")
@click.option("--ttft-p99-ms", type=click.IntRange(min=1), default=_SLO.ttft_p99_milliseconds, show_default=True,
              help="Time-to-first-token p99 SLO.")
@click.option("--itl-p99-ms", type=click.IntRange(min=1), default=_SLO.itl_p99_milliseconds, show_default=True,
              help="Inter-token latency p99 SLO; caps the decode batch.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.05, 1.0),
              default=_ENGINE.gpu_memory_utilization_percent / 100, show_default=True,
              help="Share of GPU memory vLLM may use (vLLM's flag of the same name).")
@click.option("--kv-watermark-percent", type=click.IntRange(0, 90), default=_ADMISSION.kv_watermark_percent,
              show_default=True, help="Share of KV blocks the guard keeps free.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8 stores one byte per KV element instead of the profile's.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=_ENGINE.max_num_seqs, show_default=True,
              help="vLLM's batch limit per replica.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=_ADMISSION.max_concurrency,
              show_default=True, help="Requests the guard lets into one engine at once.")
@click.option("--mfu", type=click.FloatRange(0.01, 1.0), default=DEFAULT_MFU, show_default=True,
              help="Model-FLOPs utilization assumed for prefill (and the decode compute cap).")
@click.option("--bandwidth-efficiency", type=click.FloatRange(0.01, 1.0), default=DEFAULT_BANDWIDTH_EFFICIENCY,
              show_default=True,
              help="Share of peak HBM bandwidth a decode step achieves.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.pass_context
def plan(ctx: click.Context, log_path, log_format, skip_invalid, prometheus_url, service, namespace, window,
         rps_window, gpu, model, profile_file, tensor_parallel, ttft_p99_ms, itl_p99_ms, gpu_memory_utilization,
         kv_watermark_percent, kv_cache_dtype, max_num_seqs, max_concurrency, mfu, bandwidth_efficiency,
         as_json) -> None:
    """Size a service from its request distribution: token percentiles, RPS,
    concurrent tokens, KV demand at the peak, replicas for the SLO on a GPU and
    model profile, and the prefill:decode ratio for disaggregated serving.
    Every assumption is printed with its source (docs/planning.md).

    Exits 3 when the plan is printed but the TTFT SLO cannot be met by adding replicas."""
    if bool(log_path) == bool(prometheus_url):
        raise click.UsageError("pass exactly one of --log PATH or --prometheus URL")
    if prometheus_url and not service:
        raise click.UsageError("--prometheus needs --service NAME (the engines' service label)")
    sources = _sources(ctx)
    settings = Settings(
        gpu_memory_utilization=gpu_memory_utilization, kv_watermark_percent=kv_watermark_percent,
        ttft_p99_seconds=ttft_p99_ms / 1000, itl_p99_seconds=itl_p99_ms / 1000, max_num_seqs=max_num_seqs,
        max_concurrency=max_concurrency, mfu=mfu, bandwidth_efficiency=bandwidth_efficiency,
        tensor_parallel=tensor_parallel)
    try:
        profiles = ProfileSet()
        if profile_file:
            with open(profile_file, encoding="utf-8") as f:
                profiles = load_profile_file(f.read(), name=profile_file)
        gpu_profile, model_profile = profiles.gpu(gpu), profiles.model(model)
        if kv_cache_dtype == "fp8":
            model_profile = dataclasses.replace(model_profile, kv_bytes_per_element=1)
            sources["kv_bytes_per_element"] = "--kv-cache-dtype fp8"
        if log_path:
            with click.open_file(log_path, encoding="utf-8") as f:
                log = parse_request_log(f, name="<stdin>" if log_path == "-" else log_path, format=log_format,
                                        skip_invalid=skip_invalid)
            result = plan_from_log(log, gpu_profile, model_profile, settings, window_seconds=rps_window,
                                   sources=sources)
        else:
            sample = asyncio.run(_read_prometheus(prometheus_url, service, namespace, window, rps_window))
            result = plan_from_prometheus(sample, gpu_profile, model_profile, settings, sources=sources)
    except PlanningError as e:
        raise click.ClickException(str(e)) from None
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{log_path or profile_file} is not UTF-8 text ({e.reason} at byte "
                                   f"{e.start})") from None
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else render(result), nl=as_json)
    if result.fleet.problems:
        sys.exit(EXIT_SLO_UNREACHABLE)


async def _read_prometheus(url: str, service: str, namespace: str | None, window: float, rps_window: float):
    async with PrometheusClient(url) as client:
        return await read_sample(client, service=service, namespace=namespace, window_seconds=window,
                                 rate_window_seconds=rps_window)
