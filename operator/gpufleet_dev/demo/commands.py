"""`gpufleet demo`."""
from __future__ import annotations

import asyncio
from pathlib import Path

import click


@click.command()
@click.option("--model", type=click.Choice(["smollm2", "tiny"]), default="smollm2", show_default=True,
              help="smollm2: the real SmolLM2-135M-Instruct (real text); tiny: a random tiny Llama (faster).")
@click.option("--surge-clients", default=10, show_default=True, help="Concurrent clients during the surge.")
@click.option("--out", type=click.Path(file_okay=False), default="reports", show_default=True,
              help="Where the report goes.")
def demo(model, surge_clients, out) -> None:
    """Run the whole product locally: control plane, operator, a real engine, load, and a report."""
    from .run import run_demo
    asyncio.run(run_demo(model, surge_clients, Path(out)))
