"""The `gpufleet` command."""
from __future__ import annotations

import click

from .commands import crd, run
from .fleet.audit_command import audit
from .planning.commands import plan
from .router.command import router


@click.group()
@click.version_option(package_name="gpufleet")
def main() -> None:
    """gpufleet: a Kubernetes operator for GPU LLM inference fleets."""


main.add_command(run)
main.add_command(crd)
main.add_command(audit)
main.add_command(plan)
main.add_command(router)


def _development_commands() -> list[click.Command]:
    """`gpufleet dev` and `gpufleet demo` where the dev extra is installed; in the
    operator image (no certificate or plotting libraries) a stub that says how to get them."""
    try:
        from gpufleet_dev.demo.commands import demo
        from gpufleet_dev.devcluster.commands import dev
        return [dev, demo]
    except ImportError as e:
        missing = e.name or str(e)

        def unavailable(name: str) -> click.Command:
            @click.command(name, context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def stub(args) -> None:
                raise click.ClickException(f"`gpufleet {name}` needs the development extra ({missing} is "
                                           f"missing): pip install 'gpufleet[dev]'")
            stub.help = "Development tool; needs pip install 'gpufleet[dev]'."
            return stub
        return [unavailable("dev"), unavailable("demo")]


def _engine_commands() -> list[click.Command]:
    """`gpufleet engine` where the guard's package is installed beside the operator (a development
    checkout); the operator's runtime imports only the guard's contract, and the engine image runs
    the same commands as `gpufleet-engine`."""
    try:
        from gpufleet_dev.engine_commands import engine
    except ImportError:
        return []
    return [engine]


for _command in (*_engine_commands(), *_development_commands()):
    main.add_command(_command)


if __name__ == "__main__":
    main()
