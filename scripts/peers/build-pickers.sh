#!/usr/bin/env bash
# The peer Endpoint Pickers that bench/gateway_pickers.py measures gpufleet's against, built from
# the Go module proxy at pinned versions and cached like the control-plane binaries
# (<cache>/bin/<name>-<version>-r<recipe>/epp, GPUFLEET_CACHE or ~/.cache/gpufleet). Not part of
# scripts/setup.sh or `make test`: only the benchmark needs them. A second run takes a second.
#
#   scripts/peers/build-pickers.sh [gie] [llmd]     # both when none is named
#
# gie:  the Gateway API Inference Extension's reference EPP, v1.5.0 (pure Go, ~2 min on 2 cores).
# llmd: llm-d's inference scheduler v0.4.0 (cmd/epp; cgo: its precise prefix-cache scorer links
#       libzmq, embeds Python for chat templates and links HuggingFace's tokenizers through
#       github.com/daulet/tokenizers, whose static library is built here from that module's own Rust
#       source with cargo (upstream downloads a prebuilt one); needs Debian's libzmq3-dev and
#       python3-dev, and a Rust toolchain; ~10 min the first time).
# Prints each binary's path on stdout.
set -euo pipefail
CACHE=${GPUFLEET_CACHE:-$HOME/.cache/gpufleet}
say() { printf '[peers] %s\n' "$*" >&2; }

GIE_VERSION=v1.5.0
LLMD_VERSION=v0.4.0

build() {  # name version module package cgo
  local name=$1 version=$2 module=$3 package=$4 cgo=$5 recipe=1
  local dest="$CACHE/bin/$name-$version-r$recipe"
  if [ -x "$dest/epp" ]; then echo "$dest/epp"; return; fi
  command -v go >/dev/null || { say "Go >= 1.24 is needed to build $name"; return 1; }
  say "building $name $version ($module/$package, CGO_ENABLED=$cgo; first time only, minutes)"
  local started=$SECONDS src work="$CACHE/build/$name-$version"
  # The module's own source, go.mod and go.sum (exactly the versions it pins, as `go install pkg@version`
  # would build; that command also asks the proxy for the module's version list, which is refused here).
  src=$(module_dir "$module@$version")
  rm -rf "$work" "$dest.tmp" && mkdir -p "$CACHE/build" "$dest.tmp"
  cp -r "$src" "$work" && chmod -R u+w "$work"
  (cd "$work" && CGO_ENABLED=$cgo GOFLAGS=-mod=mod go build -trimpath -ldflags='-s -w' -o "$dest.tmp/epp" "./$package" >&2)
  mv "$dest.tmp" "$dest" && rm -rf "$work"  # atomic: a half-finished build is never "cached"
  say "built $name $version in $((SECONDS - started)) s -> $dest/epp"
  echo "$dest/epp"
}

module_dir() { (cd "$CACHE" && go mod download -json "$1" | sed -n 's/.*"Dir": "\(.*\)",/\1/p'); }

gie() { build gie-epp "$GIE_VERSION" sigs.k8s.io/gateway-api-inference-extension cmd/epp 0; }

llmd() {
  local missing=()
  for p in libzmq3-dev python3-dev pkg-config; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    say "llm-d's scheduler needs ${missing[*]}: sudo apt-get install -y ${missing[*]}"
    return 1
  fi
  command -v cargo >/dev/null || { say "llm-d's scheduler needs a Rust toolchain (cargo) for libtokenizers"; return 1; }
  local tok
  tok=$(tokenizers_lib)
  # Debian's Python (python3-dev), whatever python3 is first on PATH.
  CGO_CFLAGS="$(/usr/bin/python3-config --includes)" \
  CGO_LDFLAGS="$(/usr/bin/python3-config --ldflags --embed) -L$tok -ltokenizers -ldl -lm" \
    build llmd-epp "$LLMD_VERSION" github.com/llm-d/llm-d-inference-scheduler cmd/epp 1
}

tokenizers_lib() {  # the directory holding libtokenizers.a at the version llm-d's go.sum pins
  local version=v1.22.1
  local dest="$CACHE/bin/tokenizers-$version-r1"
  if [ -f "$dest/libtokenizers.a" ]; then echo "$dest"; return; fi
  local src
  src=$(module_dir "github.com/daulet/tokenizers@$version")
  local work="$CACHE/build/tokenizers-$version"
  rm -rf "$work" && mkdir -p "$CACHE/build" && cp -r "$src" "$work" && chmod -R u+w "$work"
  say "building libtokenizers $version with cargo (first time only)"
  (cd "$work" && cargo build --release --locked --lib >&2)
  mkdir -p "$dest.tmp" && cp "$work/target/release/libtokenizers.a" "$dest.tmp/"
  mv "$dest.tmp" "$dest" && rm -rf "$work"
  echo "$dest"
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gie llmd)
for t in "${targets[@]}"; do
  case "$t" in
    gie|llmd) "$t" ;;
    *) echo "usage: scripts/peers/build-pickers.sh [gie] [llmd]" >&2; exit 2 ;;
  esac
done
