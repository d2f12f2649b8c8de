"""`gpufleet engine …` in a development checkout: the guard's own commands (serve, local, fetch,
entrypoint), registered under the operator's CLI where the guard's package is installed beside it.
The operator's runtime imports only the guard's contract; the engine image runs these commands
as `gpufleet-engine`."""
from __future__ import annotations

from gpufleet_engine.cli import engine

__all__ = ["engine"]
