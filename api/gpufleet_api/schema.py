"""The CRD's structural OpenAPI v3 schema, read off the msgspec types of ``v1alpha1``.

msgspec writes JSON Schema (``msgspec.json.schema``), but the API server takes only a
*structural* schema: every object spelled out in place (no ``$ref``), optional fields as
plain properties (no ``anyOf`` with null), int-or-string as a Kubernetes marker, defaults
fully expanded. So this walks msgspec's own description of the types (``msgspec.inspect``):
descriptions, bounds, lengths, patterns and choices from each field's ``Meta``, Kubernetes'
own keywords (CEL rules, list types, formats) from its ``extra_json_schema``, a class's CEL
rules from its ``__schema__``.
"""
from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
from msgspec import inspect as mi

from gpufleet_api import typed


def rule(expr: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict:
    """A CEL validation rule (x-kubernetes-validations entry)."""
    r = {"rule": expr, "message": message}
    if field_path:
        r["fieldPath"] = field_path
    if reason:
        r["reason"] = reason
    return r


def openapi(cls: type) -> dict:
    """The structural OpenAPI v3 schema of a model class."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls
    return _struct(info)


def _keywords(extra: dict) -> dict:
    """Class-level schema keywords: ``x_`` names become dashed (x-kubernetes-validations), others camelCase."""
    return {k.replace("_", "-") if k.startswith("x_") else typed.camel(k): v for k, v in extra.items()}


def _struct(info: mi.StructType) -> dict:
    props, required = {}, []
    declared = {f.name: f.type for f in msgspec.structs.fields(info.cls)}
    for f in info.fields:
        s = _schema(f.type)
        choices = _literal(declared[f.name])
        if choices:
            s["enum"] = choices  # as written: msgspec.inspect sorts them
        if f.required:
            required.append(f.encode_name)
        else:
            default = f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            if default is not None:
                # Nested objects default to their fully expanded defaults: the API server
                # checks CEL rules against defaults before it would expand a bare {}.
                s["default"] = typed.to_builtins(default, omit_none=True)
        props[f.encode_name] = s
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    out.update(_keywords(getattr(info.cls, "__schema__", None) or {}))
    if info.cls.__doc__:
        out["description"] = " ".join(info.cls.__doc__.split())
    return out


def _literal(tp: Any) -> list | None:
    while typing.get_origin(tp) in (typing.Annotated, typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1 and typing.get_origin(tp) is not typing.Annotated:
            return None
        tp = args[0]
    return list(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else None


def _schema(t: mi.Type) -> dict:
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        # int | str: a Kubernetes int-or-string, which carries no type of its own.
        return _schema(members[0]) if len(members) == 1 else {}
    if isinstance(t, mi.Metadata):
        s = _schema(t.type)
        extra = dict(t.extra_json_schema or {})
        own = extra.pop("description", None)
        if own is not None:
            # A nested type's own docstring adds to the field's one-liner, so
            # `kubectl explain` on the field teaches the whole concept.
            nested = s.get("description") if "properties" in s else None
            text = own + (f" {nested}" if nested and nested != own else "")
            # The field's words right after its type, where `kubectl explain` readers look.
            s = {**s, "description": text} if nested else {**{k: v for k, v in s.items() if k == "type"},
                                                            "description": text, **s}
        s.update(extra)
        return s
    if isinstance(t, mi.StructType):
        return _struct(t)
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return _bounded({"type": "array", "items": _schema(t.item_type)}, t, "Items")
    if isinstance(t, mi.DictType):
        return _bounded({"type": "object", "additionalProperties": _schema(t.value_type)}, t, "Properties")
    if isinstance(t, mi.LiteralType):
        kind = "integer" if all(isinstance(v, int) for v in t.values) else "string"
        return {"type": kind, "enum": list(t.values)}
    if isinstance(t, mi.StrType):
        s = _bounded({"type": "string"}, t, "Length")
        if t.pattern is not None:
            s["pattern"] = t.pattern
        return s
    if isinstance(t, (mi.IntType, mi.FloatType)):
        s = {"type": "integer" if isinstance(t, mi.IntType) else "number"}
        if t.ge is not None:
            s["minimum"] = t.ge
        if t.le is not None:
            s["maximum"] = t.le
        if t.gt is not None or t.lt is not None:
            raise TypeError("the API types state bounds as ge/le (minimum/maximum)")
        return s
    if isinstance(t, mi.BoolType):
        return {"type": "boolean"}
    if isinstance(t, mi.AnyType):
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    raise TypeError(f"no schema for {t!r}")


def _bounded(s: dict, t: Any, noun: str) -> dict:
    """minLength/maxLength, minItems/maxItems or minProperties/maxProperties from msgspec's lengths."""
    if t.min_length is not None:
        s[f"min{noun}"] = t.min_length
    if t.max_length is not None:
        s[f"max{noun}"] = t.max_length
    return s
