"""What the real node's network did, for a failed test's report: the nfqueue that kube-network-policies
reads (packets waiting for a verdict now, dropped because the queue was full or its reader too slow), its
verdicts, conntrack's drops, and each pod network namespace's listen drops (SYNs a full accept queue
dropped) and its guard listener's accept queue. All counters are cumulative since the node started, so
one reading after a failure says whether any SYN was lost at these places, and where."""
from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

NFQUEUE_COLUMNS = ("queue", "portid", "waiting", "copy_mode", "copy_range", "queue_dropped", "user_dropped",
                   "last_id", "1")
NSTAT = ("TcpExtListenDrops", "TcpExtListenOverflows", "TcpExtTCPReqQFullDrop", "TcpExtTCPTimeouts",
         "TcpAttemptFails")


def _run(*argv: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({' '.join(argv)}: {e})"
    return out.stdout.strip() or out.stderr.strip()


def _nfqueue() -> str:
    try:
        lines = Path("/proc/net/netfilter/nfnetlink_queue").read_text().splitlines()
    except OSError as e:
        return f"(no nfqueue: {e})"
    return "; ".join(" ".join(f"{k}={v}" for k, v in zip(NFQUEUE_COLUMNS, line.split())) for line in lines) or \
        "(no queue bound: nothing reads kube-network-policies' queue)"


def _verdicts(state_file: Path) -> str:
    try:
        port = json.loads(state_file.read_text())["ports"]["kube-network-policies-metrics"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except (OSError, KeyError, ValueError) as e:
        return f"(kube-network-policies' metrics unread: {e})"
    return "; ".join(line for line in text.splitlines() if line.startswith("kube_network_policies_packet_count"))


def _namespaces() -> list[str]:
    rows = []
    for name in _run("ip", "netns", "list").split("\n"):
        ns = name.split(" ")[0]
        if not ns or ns.startswith("("):
            continue
        address = _run("ip", "netns", "exec", ns, "ip", "-4", "-o", "addr", "show", "eth0").split()
        counters = _run("ip", "netns", "exec", ns, "nstat", "-az", *NSTAT).splitlines()[1:]
        listen = _run("ip", "netns", "exec", ns, "ss", "-ltnH", "sport = :8080").split()
        rows.append(f"{address[3] if len(address) > 3 else ns}: "
                    + " ".join(f"{c.split()[0]}={c.split()[1]}" for c in counters if len(c.split()) > 1)
                    + (f" guard accept queue {listen[1]}/{listen[2]}" if len(listen) > 2 else ""))
    return rows


def node_network_report(state_file: Path) -> str:
    return "\n".join([f"nfqueue: {_nfqueue()}", f"kube-network-policies verdicts: {_verdicts(state_file)}",
                      f"conntrack: {_run('conntrack', '-S')}", "pod network namespaces:", *_namespaces()])
