"""A throwaway etcd + kube-apiserver for the peer Endpoint Pickers, which read their replicas as Pods.

GIE's reference EPP and llm-d's scheduler are controller-runtime programs: even without an InferencePool
(``--endpoint-selector``) they list and watch Pods through a kubeconfig. This starts the control-plane
binaries the dev cluster caches (``gpufleet_dev.devcluster.binaries``; built by scripts/setup.sh) on ports
of its own in a temporary directory: no controller manager, scheduler or kubelet, and never the dev cluster
itself. The benchmark writes one Pod per local replica whose status says Ready at the replica's own
loopback address (127.0.0.2, 127.0.0.3, ...), so the pickers see the replicas as a cluster would show them.
"""
from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from gpufleet_dev.devcluster import binaries, pki
from gpufleet_dev.devcluster.cluster import write_kubeconfig
from gpufleet_dev.devcluster.layout import free_port


class StandaloneApiserver:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpufleet-bench-apiserver-"))
        self.procs: list[subprocess.Popen] = []
        self.kubeconfig = self.dir / "kubeconfig"

    def start(self, timeout: float = 90.0) -> "StandaloneApiserver":
        etcd, apiserver = binaries.ETCD.binary("etcd"), binaries.KUBERNETES.binary("kube-apiserver")
        for b in (etcd, apiserver):
            if not b.exists():
                raise RuntimeError(f"{b} is missing: scripts/setup.sh builds and caches it")
        pki_dir = self.dir / "pki"
        pki.ensure_pki(pki_dir)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [str(etcd), "--name=bench", f"--data-dir={self.dir / 'etcd'}",
                             f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                             f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                             f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                             f"--initial-cluster=bench=http://127.0.0.1:{peer_port}",
                             "--unsafe-no-fsync", "--log-level=warn"])
        self._spawn("kube-apiserver", [
            str(apiserver), f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki_dir / 'apiserver.crt'}", f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
            f"--client-ca-file={pki_dir / 'ca.crt'}", f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=RBAC", "--service-cluster-ip-range=10.97.0.0/16",
            # No controller manager creates the default ServiceAccount the Pods would need.
            "--disable-admission-plugins=ServiceAccount", "--profiling=false", "--v=0"])
        self.server = f"https://127.0.0.1:{api_port}"
        write_kubeconfig(self.kubeconfig, self.server, pki_dir, "admin")
        ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
        self.http = httpx.Client(base_url=self.server, verify=ctx, timeout=10, trust_env=False)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.http.get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"kube-apiserver not ready; logs in {self.dir}")
            time.sleep(0.5)
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.dir / f"{name}.log", "ab") as log:
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))

    def ready_pod(self, name: str, labels: dict[str, str], ports: list[int], ip: str = "127.0.0.1",
                  namespace: str = "default") -> None:
        """A Pod as a kubelet would report it running: Ready, at ``ip``, with these container ports."""
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
               "spec": {"containers": [{"name": "engine", "image": "local",
                                        "ports": [{"containerPort": p} for p in ports]}]}}
        r = self.http.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)
        r.raise_for_status()
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = r.json()
        status["status"] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                            "hostIP": "127.0.0.1", "startTime": now, "conditions": [
                                {"type": t, "status": "True", "lastTransitionTime": now}
                                for t in ("Initialized", "ContainersReady", "Ready", "PodScheduled")]}
        self.http.put(f"/api/v1/namespaces/{namespace}/pods/{name}/status", json=status).raise_for_status()

    def apply(self, path: str, obj: dict) -> None:
        """Server-side apply of one object at its API path (a CRD, an InferencePool)."""
        r = self.http.patch(f"{path}?fieldManager=gpufleet-bench&force=true", json=obj,
                            headers={"Content-Type": "application/apply-patch+yaml"})
        if r.status_code >= 400:
            raise RuntimeError(f"apply {path}: {r.status_code} {r.text[:500]}")

    def crd(self, crd: dict, timeout: float = 30.0) -> None:
        """A CustomResourceDefinition, applied and waited for until Established."""
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
        self.apply(path, {k: v for k, v in crd.items() if k != "status"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            conditions = (self.http.get(path).json().get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            time.sleep(0.2)
        raise RuntimeError(f"CRD {crd['metadata']['name']} not Established in {timeout:.0f} s")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if hasattr(self, "http"):
            self.http.close()
        shutil.rmtree(self.dir, ignore_errors=True)
