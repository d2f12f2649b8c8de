"""Capacity planning: request distribution → KV demand → replicas and prefill:decode ratio.

Pure logic apart from two edges: reading a request log (the caller passes its
lines) and querying Prometheus (``prometheus.py``). ``gpufleet plan`` wires
them together (``gpufleet.cli.plan``); ``docs/planning.md`` explains the model.
"""
