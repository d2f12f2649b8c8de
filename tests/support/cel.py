"""The CRDs' CEL rules evaluated in-process (celpy), as the API server would, for tests of the generated
schemas."""
from __future__ import annotations

import celpy

ENV = celpy.Environment()


def refusals(schema: dict, value) -> list[str]:
    """The messages of every CEL rule the value breaks, at every level of the schema."""
    out = []
    for r in schema.get("x-kubernetes-validations", []):
        if not bool(ENV.program(ENV.compile(r["rule"])).evaluate({"self": celpy.json_to_cel(value)})):
            out.append(r["message"])
    if isinstance(value, dict):
        for key, sub in value.items():
            if key in schema.get("properties", {}):
                out += refusals(schema["properties"][key], sub)
            elif "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
                out += refusals(schema["additionalProperties"], sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            out += refusals(schema["items"], item)
    return out
