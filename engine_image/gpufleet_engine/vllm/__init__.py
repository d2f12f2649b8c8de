"""What is specific to vLLM: its route table, reading its /metrics, the plugin
vLLM loads in its own processes and the GPU memory it reports through it.
"""
