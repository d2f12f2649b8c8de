"""Leader election over a coordination.k8s.io Lease, in one place: the pure rules (``records``: who holds
the Lease, when it expires, what a candidate may do), the Lease's reads and writes (``lease_store``), and
the loop that campaigns, renews and releases (``elector``)."""
