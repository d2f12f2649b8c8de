"""Ports chosen to listen on later come from below the kernel's ephemeral range, where no outgoing
connection takes its local port, and are free when chosen."""
from __future__ import annotations

import random
import socket

from gpufleet_kit import ports


def test_a_chosen_port_is_below_the_ephemeral_range_and_free():
    start = ports.ephemeral_start()
    for _ in range(20):
        port = ports.unused_port("127.0.0.1")
        assert ports.LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds


def test_a_port_in_use_is_not_chosen():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Every try lands on the port held (a generator that always answers it), then the kernel's pick.
        rigged = random.Random()
        rigged.randint = lambda a, b: taken  # type: ignore[method-assign]
        assert ports.unused_port("127.0.0.1", rng=rigged, tries=3) != taken


def test_an_unreadable_range_reads_as_the_kernels_default(tmp_path):
    assert ports.ephemeral_start(tmp_path / "missing") == 32768
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ports.ephemeral_start(tmp_path / "range") == 40000
