"""The local control plane: real etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok-simulated GPU nodes, built from the Go module proxy and
cached outside the clone."""
