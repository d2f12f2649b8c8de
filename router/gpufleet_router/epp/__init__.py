"""The Gateway API Inference Extension's Endpoint Picker: the router's second front door (docs/gateway-epp.md).

By job: protocol.py (Envoy's ext_proc messages as GIE's protocol uses them; pure), choosing.py (the answer for
one request from the router's Fleet and policy), service.py (the gRPC stream, one per request), tls.py, server.py
(the gRPC server with grpc.health.v1, started by ``gpufleet router --epp-port``)."""
