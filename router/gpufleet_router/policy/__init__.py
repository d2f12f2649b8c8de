"""The router's policy: pure, no I/O (no HTTP or Kubernetes clients, no clock of its own), so another front
door (a Gateway API Inference Extension endpoint picker) can reuse it.

What a request is and where it may go: ``requests`` (parsing a client's body), ``table`` (services, their
pools and replicas), ``adapters`` (LoRA adapter names), ``replicas`` (a replica and its guard's reading,
parsed by ``signals``). Which replica takes it: ``choice`` (the Picker), over ``prefixes`` (prefix hashing,
what was sent where, the ring). What follows: ``handoff`` (prefill to decode), ``resume`` (continuing a
broken stream), ``shedding`` (retrying a refused request), ``cold_start`` (how long a first replica takes).
It imports nothing of the router above it but ``gpufleet_router.errors``."""
