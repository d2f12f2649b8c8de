"""What every part of the local control plane shares, below all of them: where its state lives, its
address ranges, its one error, and a free port. cluster.py starts the components; node.py, dns.py and
netpol.py (which cluster.py starts) import this, not cluster.py, so the package has no import cycle."""
from __future__ import annotations

import os
from pathlib import Path

from gpufleet_kit.ports import unused_port

SERVICE_CIDR = "10.96.0.0/16"
# kwok hands out pod IPs from this range. All of 127.0.0.0/8 is loopback on
# Linux, so a local process can listen on a simulated pod's own address.
POD_CIDR = "127.64.0.0/16"


class ClusterError(Exception):
    pass


def state_dir() -> Path:
    return Path(os.environ.get("GPUFLEET_DEV_DIR", Path.home() / ".gpufleet" / "dev"))


def kubeconfig_path() -> Path:
    return state_dir() / "kubeconfig"


def free_port() -> int:
    """A loopback port free right now, outside the range outgoing connections take theirs from: the
    components bind theirs seconds later, while the others already connect (gpufleet_kit.ports)."""
    return unused_port("127.0.0.1")
