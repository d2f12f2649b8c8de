"""`gpufleet demo`."""
from __future__ import annotations

import asyncio
from pathlib import Path

import click


@click.command()
@click.option("--model", type=click.Choice(["smollm2", "tiny"]), default="smollm2", show_default=True,
              help="smollm2: the real SmolLM2-135M-Instruct (real text); tiny: a random tiny Llama (faster).")
@click.option("--real-node/--engine-backer", default=False, show_default=True,
              help="Run the engines as pods on a real kubelet (needs `make images`; on 2 cores a second "
                   "replica takes minutes to start) instead of as local processes behind simulated nodes.")
@click.option("--surge-clients", default=10, show_default=True, help="Concurrent clients during the surge.")
@click.option("--out", type=click.Path(file_okay=False), default="reports", show_default=True,
              help="Where the report goes.")
def demo(model, real_node, surge_clients, out) -> None:
    """Run the whole product locally: control plane, operator, a real engine, load, and a report."""
    from .run import run_demo
    asyncio.run(run_demo(model, surge_clients, Path(out), real_node=real_node))
