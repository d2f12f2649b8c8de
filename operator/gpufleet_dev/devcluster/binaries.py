"""Build and cache the control-plane binaries from the Go module proxy.

Each component is built in a throwaway Go module that requires the upstream
module at a pinned version (Kubernetes also needs its staging modules pinned by
``replace``). Results are cached under ``<cache>/bin/<component>-<version>/``,
so only the first ``gpufleet dev up`` on a machine pays for the build.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.19.0"
NETWORK_POLICIES_VERSION = "v0.8.0"
COREDNS_VERSION = "v1.13.2"
# Only this release is approved (issue 47): the newer ones are not.
JAEGER_VERSION = "v1.75.0"

Progress = Callable[[str], None]


def cache_root() -> Path:
    return Path(os.environ.get("GPUFLEET_CACHE", Path.home() / ".cache" / "gpufleet"))


@dataclasses.dataclass(frozen=True)
class Component:
    name: str            # directory key in the cache
    version: str
    module: str          # Go module to require
    packages: tuple[str, ...]  # main packages to build, binary named after the last path element
    outputs: tuple[str, ...]   # binary names expected after the build
    renames: tuple[tuple[str, str], ...] = ()
    ldflags: str = ""
    # A main package of our own (main.go of the throwaway module, built as the module's root package)
    # instead of the upstream ``packages``, which are then only what it imports.
    main_go: str = ""
    # Bumped when the way we build changes, so stale cached binaries are rebuilt.
    recipe: str = "1"

    @property
    def dir(self) -> Path:
        return cache_root() / "bin" / f"{self.name}-{self.version}-r{self.recipe}"

    def binary(self, name: str) -> Path:
        return self.dir / name

    def is_cached(self) -> bool:
        return all(self.binary(o).exists() for o in self.outputs)


KUBERNETES = Component(
    name="kubernetes", version=KUBERNETES_VERSION, module="k8s.io/kubernetes",
    packages=("k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kube-controller-manager",
              "k8s.io/kubernetes/cmd/kube-scheduler"),
    outputs=("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
    # Without these the binaries report v0.0.0-master and Helm's kubeVersion checks fail.
    ldflags=" ".join(f"-X {pkg}.{k}={v}"
                     for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
                     for k, v in (("gitVersion", KUBERNETES_VERSION),
                                  ("gitMajor", KUBERNETES_VERSION[1:].split(".")[0]),
                                  ("gitMinor", KUBERNETES_VERSION.split(".")[1]), ("gitTreeState", "clean"))),
    recipe="2",
)
# The node agents of a real node (`gpufleet dev up --real-node`): the same
# Kubernetes module, version and stamp as the control plane.
KUBERNETES_NODE = dataclasses.replace(
    KUBERNETES, name="kubernetes-node",
    packages=("k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes/cmd/kube-proxy"),
    outputs=("kubelet", "kube-proxy"), recipe="1",
)
ETCD = Component(
    name="etcd", version=ETCD_VERSION, module="go.etcd.io/etcd/server/v3",
    packages=("go.etcd.io/etcd/server/v3",), outputs=("etcd",), renames=(("v3", "etcd"), ("server", "etcd")),
)
KWOK = Component(
    name="kwok", version=KWOK_VERSION, module="sigs.k8s.io/kwok",
    packages=("sigs.k8s.io/kwok/cmd/kwok",), outputs=("kwok",),
)
HELM = Component(
    name="helm", version=HELM_VERSION, module="helm.sh/helm/v3",
    packages=("helm.sh/helm/v3/cmd/helm",), outputs=("helm",),
)
# The real node's NetworkPolicy enforcement (netpol.py) and cluster DNS (dns.py).
NETWORK_POLICIES = Component(
    name="kube-network-policies", version=NETWORK_POLICIES_VERSION, module="sigs.k8s.io/kube-network-policies",
    packages=("sigs.k8s.io/kube-network-policies/cmd",), outputs=("kube-network-policies",),
    renames=(("cmd", "kube-network-policies"),),
)
# CoreDNS's own main imports every plugin (cloud DNS SDKs, tracers: 7.4 min to build here);
# this one imports those dns.corefile uses, as CoreDNS documents for a custom build. The
# directives' order stays CoreDNS's (core/dnsserver/zdirectives.go).
COREDNS_PLUGINS = ("bind", "cache", "errors", "health", "kubernetes", "loadbalance", "ready")
COREDNS = Component(
    name="coredns", version=COREDNS_VERSION, module="github.com/coredns/coredns",
    packages=("github.com/coredns/coredns/coremain",
              *(f"github.com/coredns/coredns/plugin/{p}" for p in COREDNS_PLUGINS)),
    outputs=("coredns",),
    main_go="package main\n\nimport (\n\t\"github.com/coredns/coredns/coremain\"\n" + "".join(
        f'\t_ "github.com/coredns/coredns/plugin/{p}"\n' for p in COREDNS_PLUGINS) + ")\n\n"
        "func main() { coremain.Run() }\n",
    recipe="2",
)
# The local cluster's trace store (docs/tracing.md): Jaeger's all-in-one binary (OTLP in, query API and UI out).
JAEGER = Component(
    name="jaeger", version=JAEGER_VERSION, module="github.com/jaegertracing/jaeger",
    packages=("github.com/jaegertracing/jaeger/cmd/jaeger",), outputs=("jaeger",),
)
CONTROL_PLANE = (ETCD, KUBERNETES, KWOK)
NODE_SERVICES = (NETWORK_POLICIES, COREDNS)


def _go_env() -> dict:
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env.setdefault("GOFLAGS", "-mod=mod")
    return env


def _staging_replaces(version: str, env: dict) -> list[str]:
    """k8s.io/kubernetes replaces its staging modules with local paths, which a
    dependent module cannot use: pin each one to the matching v0.x.y instead."""
    out = subprocess.run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
                         check=True, capture_output=True, text=True, env=env)
    gomod = Path(json.loads(out.stdout)["GoMod"]).read_text()
    staging = "v0." + version.lstrip("v").split(".", 1)[1]
    lines = []
    for line in gomod.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            lines.append(f"\t{parts[0]} => {parts[0]} {staging}")
    if not lines:
        raise RuntimeError(f"found no staging replaces in k8s.io/kubernetes@{version} go.mod")
    return lines


def build(component: Component, progress: Progress = print) -> Path:
    if component.is_cached():
        return component.dir
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to build the local control plane; install Go >= 1.24")
    env = _go_env()
    work = cache_root() / "build" / f"{component.name}-{component.version}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gomod = [f"module gpufleet.local/build/{component.name}", "", "go 1.24", "",
             f"require {component.module} {component.version}", ""]
    if component.module == "k8s.io/kubernetes":
        gomod += ["replace (", *_staging_replaces(component.version, env), ")", ""]
    (work / "go.mod").write_text("\n".join(gomod))
    if component.main_go:
        (work / "main.go").write_text(component.main_go)
    else:
        imports = "\n".join(f'\t_ "{p}"' for p in component.packages)
        (work / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    started = time.monotonic()
    progress(f"building {component.name} {component.version} from the Go module proxy "
             f"(first time only; several minutes on 2 cores)...")
    subprocess.run(["go", "mod", "tidy"], cwd=work, check=True, env=env)
    out = work / "out"
    out.mkdir()
    proc = subprocess.Popen(["go", "build", "-trimpath", f"-ldflags=-s -w {component.ldflags}".strip(),
                             "-o", str(out) + "/",
                             *(["."] if component.main_go else component.packages)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while True:
        try:
            output, _ = proc.communicate(timeout=30)
            break
        except subprocess.TimeoutExpired:
            progress(f"  ... still building {component.name} ({time.monotonic() - started:.0f}s)")
    if proc.returncode != 0:
        sys.stderr.write(output)
        raise RuntimeError(f"go build of {component.name} {component.version} failed (see output above)")
    for old, new in component.renames:
        if (out / old).exists():
            (out / old).rename(out / new)
    missing = [o for o in component.outputs if not (out / o).exists()]
    if missing:
        raise RuntimeError(f"build of {component.name} produced no {missing} in {out}")
    component.dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = component.dir.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, tmp)
    tmp.rename(component.dir)  # atomic: a half-finished build is never "cached"
    shutil.rmtree(work, ignore_errors=True)
    progress(f"built {component.name} {component.version} in {time.monotonic() - started:.0f}s "
             f"-> {component.dir}")
    return component.dir


KWOK_STAGE_FILES = ("node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
                    "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml")


def ensure_kwok_stages() -> Path:
    """kwok's default node and pod lifecycle stages ship as YAML in its module,
    not in the binary: keep a copy beside the cached binary."""
    dest = KWOK.dir / "stages"
    if all((dest / Path(f).name).exists() for f in KWOK_STAGE_FILES):
        return dest
    out = subprocess.run(["go", "mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK.version}"],
                         check=True, capture_output=True, text=True, env=_go_env(), cwd=cache_root())
    src = Path(json.loads(out.stdout)["Dir"]) / "kustomize" / "stage"
    dest.mkdir(parents=True, exist_ok=True)
    for f in KWOK_STAGE_FILES:
        shutil.copyfile(src / f, dest / Path(f).name)
    return dest


def ensure_control_plane(progress: Progress = print) -> dict[str, Path]:
    for c in CONTROL_PLANE:
        build(c, progress)
    ensure_kwok_stages()
    return {
        "etcd": ETCD.binary("etcd"),
        "kube-apiserver": KUBERNETES.binary("kube-apiserver"),
        "kube-controller-manager": KUBERNETES.binary("kube-controller-manager"),
        "kube-scheduler": KUBERNETES.binary("kube-scheduler"),
        "kwok": KWOK.binary("kwok"),
    }


def ensure_helm(progress: Progress = print) -> Path:
    found = shutil.which("helm")
    if found:
        return Path(found)
    build(HELM, progress)
    return HELM.binary("helm")


def ensure_node_agents(progress: Progress = print) -> dict[str, Path]:
    """The real node's binaries: kubelet, kube-proxy, kube-network-policies and CoreDNS."""
    for c in (KUBERNETES_NODE, *NODE_SERVICES):
        build(c, progress)
    return {name: c.binary(name) for c in (KUBERNETES_NODE, *NODE_SERVICES) for name in c.outputs}


def ensure_all(progress: Progress = print, traces: bool = True) -> None:
    """Every Go binary the tests and the demo use: the control plane, Helm, the real node's agents and,
    with ``traces``, the trace store (last: only `gpufleet dev up` and the tracing tests need it, and its
    build is the longest after Kubernetes'; `make demo` goes without it)."""
    ensure_control_plane(progress)
    ensure_helm(progress)
    ensure_node_agents(progress)
    if traces:
        build(JAEGER, progress)


if __name__ == "__main__":
    # scripts/setup.sh runs this with the system Python before the virtualenv exists (this module
    # needs nothing beyond the standard library and Go), so the builds overlap the Python installs.
    try:
        ensure_all(lambda m: print(f"[go builds] {m}", flush=True), traces="--no-traces" not in sys.argv[1:])
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"[go builds] failed: {e}", flush=True)
        sys.exit(1)
