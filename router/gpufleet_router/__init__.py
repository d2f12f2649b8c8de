"""`gpufleet router`: one OpenAI endpoint for every InferenceService in scope (docs/router.md).

``policy`` is pure (what a request is, which replica takes it); the modules beside it do the I/O:
server (the app), forwarding, streaming and prefill (sending to replicas), exchange, fleet, discovery."""
