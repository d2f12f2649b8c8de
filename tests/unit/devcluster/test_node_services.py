"""The real node's DNS and NetworkPolicy enforcement, as rendered: CoreDNS serves the
cluster's zone only, the kube-dns Service and its EndpointSlice point at it on the
node, the kubelet hands pods that Service, and kube-network-policies logs in as a pod."""
import ipaddress
from pathlib import Path

import yaml

from gpufleet_dev.devcluster import accounts, binaries, dns, netpol, node
from gpufleet_dev.devcluster.cluster import SERVICE_CIDR


def test_coredns_serves_the_cluster_zone_on_the_node_address_and_forwards_nothing():
    conf = dns.corefile("10.213.0.1", Path("/s/kubeconfig"), 1111, 2222)
    first_line = conf.splitlines()[0]
    assert first_line.split()[:-1] == ["cluster.local:53", "in-addr.arpa:53", "ip6.arpa:53"]
    assert "bind 10.213.0.1" in conf
    assert "kubeconfig /s/kubeconfig gpufleet-local" in conf
    assert "ready 127.0.0.1:2222" in conf and "health 127.0.0.1:1111" in conf
    # No root zone, no forward: names outside the cluster are refused, never sent off the machine.
    assert "forward" not in conf and ".:53" not in conf


def test_coredns_logs_in_with_its_service_account_token():
    config = yaml.safe_load(dns.kubeconfig("https://10.213.0.1:6443", Path("/s/account")))
    assert config["users"][0]["user"] == {"tokenFile": "/s/account/token"}
    assert config["clusters"][0]["cluster"] == {"server": "https://10.213.0.1:6443",
                                                "certificate-authority": "/s/account/ca.crt"}
    assert config["current-context"] == "gpufleet-local"


def test_kube_dns_has_a_fixed_cluster_ip_and_an_endpointslice_at_coredns_on_the_node():
    service, slice_ = dns.service_objects("10.213.0.1")
    assert ipaddress.ip_address(dns.CLUSTER_DNS_IP) in ipaddress.ip_network(SERVICE_CIDR)
    assert (service["metadata"]["namespace"], service["metadata"]["name"]) == ("kube-system", "kube-dns")
    assert service["spec"]["clusterIP"] == dns.CLUSTER_DNS_IP and "selector" not in service["spec"]
    assert {(p["name"], p["protocol"], p["port"]) for p in service["spec"]["ports"]} == {
        ("dns", "UDP", 53), ("dns-tcp", "TCP", 53)}
    # kube-proxy matches a slice to its Service by this label and the ports by name.
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert slice_["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] != \
        "endpointslice-controller.k8s.io"
    assert slice_["endpoints"] == [{"addresses": ["10.213.0.1"], "conditions": {"ready": True}}]
    assert {p["name"] for p in slice_["ports"]} == {p["name"] for p in service["spec"]["ports"]}


def test_the_kubelet_gives_pods_the_cluster_dns_and_no_host_search_domains(tmp_path):
    config = yaml.safe_load(node.kubelet_config(tmp_path, tmp_path / "pki", 1, 2))
    assert config["clusterDNS"] == [dns.CLUSTER_DNS_IP]
    assert config["clusterDomain"] == "cluster.local"
    assert config["resolvConf"] == str(tmp_path / "resolv.conf")
    assert node.node_resolv_conf() == f"nameserver {node.NODE_IP}\n"


def test_kube_network_policies_finds_its_token_where_in_cluster_login_reads_it():
    argv = netpol.argv(Path("/bin/knp"), Path("/state/account"), "real-node-0", 9999)
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    script = argv[-1]
    assert "mount --bind /state/account /run/secrets/kubernetes.io/serviceaccount" in script
    assert script.index("mount -t tmpfs") < script.index("mount --bind") < script.index("exec /bin/knp")
    assert "--hostname-override=real-node-0" in script and "--metrics-bind-address=127.0.0.1:9999" in script
    assert "--disable-nri" in script
    assert netpol.environment("10.213.0.1", 6443) == {"KUBERNETES_SERVICE_HOST": "10.213.0.1",
                                                      "KUBERNETES_SERVICE_PORT": "6443"}


def test_the_node_services_accounts_may_only_read():
    for name, rules in ((netpol.NAME, netpol.RULES), (dns.NAME, dns.RULES)):
        sa, role, binding = accounts.account_objects(name, rules)
        assert sa["metadata"] == {"name": name, "namespace": "kube-system", "labels": sa["metadata"]["labels"]}
        assert all(set(rule["verbs"]) <= {"list", "watch"} for rule in role["rules"])
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}]


def test_the_node_services_are_built_with_the_node_agents():
    assert {binaries.NETWORK_POLICIES, binaries.COREDNS} <= set(binaries.NODE_SERVICES)
    assert binaries.NETWORK_POLICIES.packages == ("sigs.k8s.io/kube-network-policies/cmd",)
    assert ("cmd", "kube-network-policies") in binaries.NETWORK_POLICIES.renames


def test_without_nftables_queue_iptables_steers_pod_connections_to_its_queue_as_its_table_would():
    rules = netpol.steering_rules("10.244.0.0/24")
    post = [r[4:] for r in rules if r[:4] == ["-t", "mangle", "-A", netpol.CHAIN]]
    queue = ["-j", "NFQUEUE", "--queue-num", "100"]
    # Its exceptions first, in its order: UDP DNS (judged after DNAT instead), root, established.
    assert post == [["-p", "udp", "--dport", "53", "-j", "RETURN"],
                    ["-m", "owner", "--uid-owner", "0", "-j", "RETURN"],
                    ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"],
                    ["-s", "10.244.0.0/24", *queue], ["-d", "10.244.0.0/24", *queue]]
    dns = [r[4:] for r in rules if r[:4] == ["-t", "mangle", "-A", netpol.DNS_CHAIN]]
    assert all(r[:4] == ["-p", "udp", "--dport", "53"] and r[-4:] == queue for r in dns) and len(dns) == 2
    # Hooked where its chains are: POSTROUTING (before SNAT), and after DNAT for DNS; no bypass.
    hooks = {(r[3], r[5]) for r in rules if r[2] == "-A" and r[4] == "-j" and r[3].isupper() and len(r) == 6}
    assert hooks == {("POSTROUTING", netpol.CHAIN), ("INPUT", netpol.DNS_CHAIN), ("FORWARD", netpol.DNS_CHAIN)}
    assert not any("--queue-bypass" in r for r in rules)
    # Chains are created before rules go into them.
    created = {r[3]: i for i, r in enumerate(rules) if r[2] == "-N"}
    assert set(created) == {netpol.CHAIN, netpol.DNS_CHAIN}
    assert all(created[r[3]] < i for i, r in enumerate(rules) if r[2] == "-A" and r[3] in created)
    assert all(created[r[5]] < i for i, r in enumerate(rules) if len(r) == 6 and r[5] in created)
