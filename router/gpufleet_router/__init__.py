"""`gpufleet router`: one OpenAI endpoint for every InferenceService in scope (docs/router.md).

choice, requests, signals and table are pure; server does the I/O."""
