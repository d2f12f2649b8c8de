"""The admission core: what the guard decides, without sockets.

The KV ledger, the demand model and reservation policy, queues and classes,
the scheduler, the TTFT control, retry hints and request costing, put together
in ``core.Admission``, which ``configure(config)`` sets up at start-up and on
every live reload. Imports only ``gpufleet_api.guard``.
"""
