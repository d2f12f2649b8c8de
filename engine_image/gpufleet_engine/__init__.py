"""gpufleet's engine guard: admission control in front of a vLLM OpenAI server.

Entry points: ``gpufleet engine serve`` (the guard), ``gpufleet engine local``
(vLLM-CPU + guard on a tiny model), ``python -m gpufleet_engine.launch.entrypoint``
(the container's PID 1) and ``gpufleet_engine.local.runner.LocalEngine``.
"""
