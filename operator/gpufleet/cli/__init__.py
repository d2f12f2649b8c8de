"""The `gpufleet` command."""
from __future__ import annotations

import click

from gpufleet_router.cli import router

# The commands' modules, not their functions, in this namespace: ``gpufleet.cli.audit`` is the module.
from . import audit, plan, run, tenants, usage


@click.group()
@click.version_option(package_name="gpufleet")
def main() -> None:
    """gpufleet: a Kubernetes operator for GPU LLM inference fleets."""


main.add_command(run.run)
main.add_command(run.crd)
main.add_command(audit.audit)
main.add_command(plan.plan)
main.add_command(tenants.tenants)
main.add_command(usage.usage)
main.add_command(router)


def _unavailable(name: str, why: str, help_: str) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def stub(args) -> None:
        raise click.ClickException(f"`gpufleet {name}` {why}")
    stub.help = help_
    return stub


def _development_commands() -> list[click.Command]:
    """`gpufleet dev` and `gpufleet demo` where the dev extra is installed; in the
    operator image (no certificate or plotting libraries) a stub that says how to get them."""
    try:
        from gpufleet_dev.demo.cli import demo
        from gpufleet_dev.devcluster.cli import dev
        return [dev, demo]
    except ImportError as e:
        why = f"needs the development extra ({e.name or e} is missing): pip install 'gpufleet[dev]'"
        return [_unavailable(n, why, "Development tool; needs pip install 'gpufleet[dev]'.") for n in ("dev", "demo")]


def _engine_command() -> click.Command:
    """`gpufleet engine` (the guard, the local runner) in a development checkout, through gpufleet_dev:
    the operator's runtime imports only the guard's contract. In the operator image, which carries
    only that contract (operator/Dockerfile), a stub that says where the guard runs."""
    try:
        from gpufleet_dev.engine_commands import engine
        return engine
    except ImportError:
        return _unavailable("engine", "runs in the engine image (its command there is gpufleet-engine), or from a "
                            "checkout: pip install -e '.[engine,dev]'", "The guard and local engine runner (not in "
                            "the operator image).")


for _command in (*_development_commands(), _engine_command()):
    main.add_command(_command)
