"""The engine container's processes: the entrypoint that supervises vLLM, its
flags, the model fetch, the CPU budget.
"""
