#!/usr/bin/env bash
# Install Prometheus and promtool from Debian's `prometheus` package, and
# amtool from `prometheus-alertmanager`; the alert-rule and dashboard tests
# need promtool, the Alertmanager config test uses amtool when present.
# Idempotent: does nothing when both are already on PATH. Runs apt-get as
# root, or through sudo.
set -euo pipefail
say() { printf '\033[1m[prometheus]\033[0m %s\n' "$*" >&2; }

if command -v promtool >/dev/null 2>&1 && command -v amtool >/dev/null 2>&1; then
  say "promtool present: $(promtool --version 2>&1 | head -n1)"
  exit 0
fi

# promtool alone is enough where amtool cannot be installed.
if command -v promtool >/dev/null 2>&1 && { [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1 \
    || ! command -v apt-get >/dev/null 2>&1; }; then
  say "promtool present, amtool missing and not installable here: $(promtool --version 2>&1 | head -n1)"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  echo "promtool is missing and installing it needs root or sudo" >&2
  exit 1
fi
command -v apt-get >/dev/null 2>&1 || {
  echo "promtool is missing and this is not a Debian/Ubuntu system; install Prometheus's promtool by hand" >&2
  exit 1
}

say "installing the prometheus package (for promtool)"
${SUDO[@]+"${SUDO[@]}"} apt-get update -qq
# The package's post-install script tries to start the service, which fails
# without systemd; the binaries are installed all the same, so judge by them.
${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null || true
# Optional: without amtool the Alertmanager config is checked by structure only.
${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null || true

if ! command -v promtool >/dev/null 2>&1; then
  echo "apt-get did not install promtool" >&2
  exit 1
fi
say "installed: $(promtool --version 2>&1 | head -n1)"
