"""An object checked offline against a CRD's structural openAPIV3Schema, as the API server would before it stores
it: types, required fields, enums, patterns, bounds, list and map sizes, and fields the schema does not know (the
API server prunes those silently, so a builder that writes one has a bug), plus the CEL rules (tests/support/cel.py).
Only what structural CRD schemas use; enough for the GIE CRDs and ours."""
from __future__ import annotations

import re

from tests.support.cel import refusals

TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def problems(schema: dict, value, path: str = "") -> list[str]:
    """Every way ``value`` breaks ``schema`` (its type, keywords and CEL rules, after the schema's defaults as
    the API server fills them in), each with its path."""
    value = defaulted(schema, value)
    return _structural(schema, value, path) + [f"{path or '.'}: {m}" for m in refusals(schema, value)]


def defaulted(schema: dict, value):
    """``value`` with the schema's defaults filled in where a field is absent."""
    if isinstance(value, dict):
        out = {k: defaulted(schema.get("properties", {}).get(k, {}), v) for k, v in value.items()}
        for key, sub in schema.get("properties", {}).items():
            if key not in out and "default" in sub:
                out[key] = defaulted(sub, sub["default"])
        return out
    if isinstance(value, list):
        return [defaulted(schema.get("items", {}), item) for item in value]
    return value


def _structural(schema: dict, value, path: str) -> list[str]:
    out: list[str] = []
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            return [f"{path}: {value!r} is neither an integer nor a string"]
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{path}: {value!r} is not an integer"]
    elif kind == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return [f"{path}: {value!r} is not a number"]
    elif kind in TYPES and not isinstance(value, TYPES[kind]):
        return [f"{path}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            out.append(f"{path}: length {len(value)} out of bounds")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > schema.get("maximum", value) or value < schema.get("minimum", value):
            out.append(f"{path}: {value} out of bounds")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)) or len(value) < schema.get("minItems", 0):
            out.append(f"{path}: {len(value)} items out of bounds")
        for i, item in enumerate(value):
            out += _structural(schema.get("items", {}), item, f"{path}[{i}]")
    if isinstance(value, dict):
        if len(value) > schema.get("maxProperties", len(value)) or len(value) < schema.get("minProperties", 0):
            out.append(f"{path}: {len(value)} properties out of bounds")
        out += [f"{path}.{k}: required" for k in schema.get("required", []) if k not in value]
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                out += _structural(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _structural(extra, sub, f"{path}.{key}")
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{key}: unknown field (the API server would prune it)")
    return out
