"""A port to listen on later, that no outgoing connection takes meanwhile.

``bind(("", 0))`` hands out a port from the kernel's ephemeral range, the same range every outgoing
connection's local port comes from. A port chosen that way and bound seconds later (a control-plane
component that starts after others, a vLLM that imports for a minute before it listens) can be taken by
any connection opened in between: "address already in use", more often the busier the machine. A port
below that range is handed to no connection; it is chosen at random and checked free now, so only a
process that listens on that very port meanwhile can still take it."""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_start(path: Path = EPHEMERAL) -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def unused_port(host: str = "127.0.0.1", rng: random.Random | None = None, tries: int = 200) -> int:
    """A port free on ``host`` now, below the ephemeral range when there is room there (else any the
    kernel hands out)."""
    top = ephemeral_start() - 1
    pick = rng or random.SystemRandom()
    if top > LOWEST:
        for _ in range(tries):
            port = pick.randint(LOWEST, top)
            if _free(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
