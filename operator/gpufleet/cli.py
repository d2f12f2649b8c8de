"""The `gpufleet` command."""
from __future__ import annotations

import click

from .commands import crd, run
from .demo.commands import demo
from .devcluster.commands import dev
from .fleet.audit_command import audit
from .planning.commands import plan
from gpufleet_engine.cli import engine


@click.group()
@click.version_option(package_name="gpufleet")
def main() -> None:
    """gpufleet: a Kubernetes operator for GPU LLM inference fleets."""


main.add_command(dev)
main.add_command(run)
main.add_command(crd)
main.add_command(demo)
main.add_command(audit)
main.add_command(plan)
main.add_command(engine)


if __name__ == "__main__":
    main()
