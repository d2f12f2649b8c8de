"""The guard's HTTP layer: the aiohttp server, the request path, refusals, the
upstream to vLLM, reload and drain. Talks to the admission core
(``gpufleet_engine.admission``) through ``Admission``; nothing below imports it.
"""
