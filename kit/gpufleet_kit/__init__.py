"""The kit: cross-cutting pieces every component uses, each written once (docs/operator-design.md).

``backoff`` (pauses between tries), ``stats`` (nearest-rank percentiles), ``http_limits`` (capped reads of a
replica's reply, for the operator and the router), ``errors`` (``KitError``, the kit's
exception root; ``kube.errors.KubeError`` derives from it) and ``kube`` (the async Kubernetes client, its informer
and watch cache: the operator's and the router's one way to the apiserver). It imports only the
standard library and third-party packages: no component, not the API."""
