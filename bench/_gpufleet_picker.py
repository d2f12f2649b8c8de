"""gpufleet's Endpoint Picker for bench/gateway_pickers.py, in a process of its own as the peers run.

The router's own ``Fleet`` over a fixed table of the benchmark's replicas and adapters (what
tests/support/router.py puts in front of engine tests, and what discovery would build from the
InferenceService and its pods), reading the guards as the router does, and the router's ``EppServer``
(router/gpufleet_router/epp) in plaintext, as ``gpufleet router --epp-port P --no-epp-secure-serving``
serves it. No HTTP front door: Envoy is the only way in.

    python bench/_gpufleet_picker.py --port P --replicas 127.0.0.2:8000,... --model tiny --block-size 32 \\
        [--adapters gw-0,gw-1]
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = "router/gpufleet_router/epp/server.py"


def gpufleet_picker_missing() -> str | None:
    """Why arm (a) cannot run, or None."""
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", SERVER], cwd=ROOT, capture_output=True)
    if tracked.returncode != 0:
        return f"gpufleet's endpoint picker is not committed on main ({SERVER} is not tracked)"
    try:
        import gpufleet_router.epp.server  # noqa: F401
    except ImportError as e:
        return f"gpufleet's endpoint picker does not import: {e}"
    return None


class GpufleetPicker:
    def __init__(self, work: Path, port: int, hosts: list[str], guard_port: int, model: str, block_size: int,
                 adapters: list[str]):
        from _peer_pickers import PickerProcess

        argv = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), "--model", model,
                "--block-size", str(block_size), "--replicas", ",".join(f"{h}:{guard_port}" for h in hosts),
                "--adapters", ",".join(adapters)]
        self.process = PickerProcess("gpufleet-epp", argv, work, None)

    def start(self) -> "GpufleetPicker":
        self.process.start()
        return self

    def alive(self) -> bool:
        return self.process.alive()

    def tail(self, n: int = 4000) -> str:
        return self.process.tail(n)

    def stop(self) -> None:
        self.process.stop()


async def serve(args: argparse.Namespace) -> None:
    from gpufleet_router.epp.server import EppServer
    from gpufleet_router.metrics import RouterMetrics
    from gpufleet_router.policy.adapters import Adapter, Catalog
    from gpufleet_router.policy.replicas import Replica
    from gpufleet_router.policy.table import Route, Table
    from gpufleet_router.server import Fleet, Router, RouterSettings, client_session

    settings = RouterSettings(epp_port=args.port, epp_secure=False)
    fleet = Fleet(settings, RouterMetrics())
    http = client_session(settings)
    replicas = tuple(Replica(f"replica-{i}", a) for i, a in enumerate(args.replicas.split(",")))
    route = Route("bench", args.model, args.model, args.block_size, len(replicas), len(replicas), replicas)
    names = [a for a in args.adapters.split(",") if a]
    fleet.update(Table({args.model: route}),
                 Catalog({n: Adapter(n, "bench", args.model, args.model, n) for n in names}))
    await fleet.read_once(http)
    reads = asyncio.create_task(fleet.read(http))
    epp = EppServer(fleet, Router(fleet, http).body_budget, "127.0.0.1")
    await epp.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await epp.stop(1.0)
    reads.cancel()
    await http.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replicas", required=True, help="the guards' host:port, comma-separated")
    ap.add_argument("--model", required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--adapters", default="")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
