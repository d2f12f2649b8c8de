"""`python -m gpufleet.cli`: the `gpufleet` command."""
from . import main

main()
