"""A small typed-model kit: dataclasses whose field metadata generates the
OpenAPI v3 schema of the CRD and parses (with defaults) the objects the API
server returns. The types are the one source of the schema.

Python attribute names are snake_case; the API names are camelCase, derived.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


class SpecError(ValueError):
    """An object does not fit its type; ``path`` names the field."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def field(description: str, *, default: Any = dataclasses.MISSING, factory: Any = None,
          api_name: str | None = None, **schema: Any) -> Any:
    """A model field. ``schema`` holds extra OpenAPI keywords (enum, minimum,
    maximum, pattern, x_kubernetes_validations, ...; underscores become dashes
    for ``x_`` keys)."""
    meta = {"description": description, "schema": schema, "api_name": api_name}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def rule(expr: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict:
    """A CEL validation rule (x-kubernetes-validations entry)."""
    r = {"rule": expr, "message": message}
    if field_path:
        r["fieldPath"] = field_path
    if reason:
        r["reason"] = reason
    return r


def api_name(f: dataclasses.Field) -> str:
    return f.metadata.get("api_name") or camel(f.name)


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _schema_keywords(extra: dict) -> dict:
    out = {}
    for k, v in extra.items():
        if k.startswith("x_"):
            out[k.replace("_", "-")] = v
        else:
            out[camel(k)] = v
    return out


def _type_schema(tp) -> dict:
    tp, _ = _unwrap_optional(tp)
    if dataclasses.is_dataclass(tp):
        return openapi(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": _type_schema(item)}
    if origin is dict:
        _, val = typing.get_args(tp)
        return {"type": "object", "additionalProperties": _type_schema(val)}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is Any:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    raise TypeError(f"unsupported field type {tp!r}")


def _default_value(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def to_api(value):
    """A parsed model (or part of one) back to its API dict form."""
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is not None:
                out[api_name(f)] = to_api(v)
        return out
    if isinstance(value, list):
        return [to_api(v) for v in value]
    if isinstance(value, dict):
        return {k: to_api(v) for k, v in value.items()}
    return value


def openapi(cls) -> dict:
    """The structural OpenAPI v3 schema of a model class."""
    hints = typing.get_type_hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        extra = f.metadata.get("schema", {})
        # int-or-string (Kubernetes quantities) carries no type of its own.
        s = {} if extra.get("x_kubernetes_int_or_string") else _type_schema(tp)
        # A nested type's own docstring adds to the field's one-liner, so
        # `kubectl explain` on the field teaches the whole concept.
        nested_doc = s.get("description") if "properties" in s else None
        own = f.metadata["description"]
        s["description"] = own + (f" {nested_doc}" if nested_doc and nested_doc != own else "")
        s.update(_schema_keywords(f.metadata.get("schema", {})))
        default = _default_value(f)
        if default is dataclasses.MISSING:
            _, optional = _unwrap_optional(tp)
            if not optional:
                required.append(api_name(f))
        elif default is not None:
            # Nested objects default to their fully expanded defaults: the API server
            # checks CEL rules against defaults before it would expand a bare {}.
            s["default"] = to_api(default)
        props[api_name(f)] = s
    out = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    doc = getattr(cls, "__schema__", None) or {}
    out.update(_schema_keywords(doc))
    if cls.__doc__:
        out["description"] = " ".join(cls.__doc__.split())
    return out


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """Resolved annotations of a dataclass; resolving them is slow, so once per class."""
    return typing.get_type_hints(cls)


def parse(cls, data: Any, path: str = "spec"):
    """Build ``cls`` from an API dict, applying defaults; errors name the field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(path, f"must be an object, not {type(data).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = api_name(f)
        sub = f"{path}.{name}"
        if name in data and data[name] is not None:
            kwargs[f.name] = _parse_value(hints[f.name], data[name], sub)
        else:
            default = _default_value(f)
            if default is dataclasses.MISSING:
                _, optional = _unwrap_optional(hints[f.name])
                if not optional:
                    raise SpecError(sub, "is required")
                kwargs[f.name] = None
            elif dataclasses.is_dataclass(default):
                kwargs[f.name] = parse(type(default), {}, sub)
            else:
                kwargs[f.name] = default
        enum = f.metadata.get("schema", {}).get("enum")
        if enum and kwargs[f.name] is not None and kwargs[f.name] not in enum:
            raise SpecError(sub, f"must be one of {', '.join(map(str, enum))}, not {kwargs[f.name]!r}")
    return cls(**kwargs)


def _parse_value(tp, value, path):
    tp, _ = _unwrap_optional(tp)
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(path, "must be a list")
        (item,) = typing.get_args(tp)
        return [_parse_value(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, "must be an object")
        _, val = typing.get_args(tp)
        return {str(k): _parse_value(val, v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError(path, f"must be an integer, not {value!r}")
    if tp is str and not isinstance(value, str):
        raise SpecError(path, f"must be a string, not {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, not {value!r}")
    return value
