"""Development tools, not shipped in the operator's runtime: the local control
plane with simulated GPU nodes and real engine processes (``devcluster``) and
the end-to-end demo (``demo``). Their dependencies (certificate generation,
plotting) come with the ``dev`` extra: ``pip install 'gpufleet[dev]'``.
"""
