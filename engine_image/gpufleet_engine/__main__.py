"""``python -m gpufleet_engine …``: the ``gpufleet engine`` commands without the operator's CLI."""
from gpufleet_engine.cli import engine

engine(prog_name="gpufleet-engine")
