"""The typed-model kit of the API types and of ``guard.json``: msgspec Structs.

A model is a ``Model`` subclass (msgspec.Struct): Python names snake_case, document keys
camelCase (``msgspec.field(name=...)`` where the derived name is wrong), bounds, lengths and
patterns as ``Annotated[T, msgspec.Meta(...)]``, choices as ``Literal``. msgspec converts a
decoded document into the model (defaults applied, types and bounds checked) and encodes it
back. This module adds what msgspec leaves to its users: msgspec stops at the first problem and
words it for a programmer (``Expected `int` >= 1 - at `$.queueClasses[4].level```), while the
people who write these documents want every problem at once, each named by its camelCase path
with the value found and what to use instead. ``convert`` and ``salvage`` ask msgspec again
field by field to name them all. Shared by the operator and the guard; pure.
"""
from __future__ import annotations

import collections.abc
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

from .errors import ContractError

T = TypeVar("T")
Loc = tuple[str | int, ...]


class Model(msgspec.Struct, frozen=True, rename="camel"):
    """Base of every typed model: attributes snake_case, document keys camelCase, immutable
    (subclasses repeat ``frozen=True``, which type checkers want to see)."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a document: where (``loc``, keys and list indices) and what."""
    loc: Loc
    message: str

    @property
    def path(self) -> str:
        return path_of(self.loc)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.loc else self.message


class Invalid(ContractError):
    """A document does not fit its model; ``problems`` names every field that is wrong."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


class Key(str):
    """A key of a map (``dict[str, T]``) in a ``Loc``, as opposed to a field: shown as ``['key']``."""


def path_of(loc: Loc, root: str = "") -> str:
    """``loc`` as people write it: ``queueClasses[4].level``, ``defaultClassByRoute['/v1/x']``."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, Key):
            out += f"[{str(part)!r}]"
        else:
            out += f".{part}" if out else part
    return out


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def drop_nulls(value: Any) -> Any:
    """A document without its null entries: a key set to null counts as left out (its default)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def convert(tp: type[T], raw: Any, *, unknown: str = "unknown field") -> T:
    """``raw`` (decoded JSON/YAML) as ``tp``, defaults applied; raises Invalid naming every problem."""
    raw = drop_nulls(raw)
    try:
        return msgspec.convert(raw, tp, strict=True)
    except msgspec.ValidationError as e:
        raise Invalid(problems(tp, raw, unknown=unknown) or [Problem((), _bare_message(str(e)))]) from None


def salvage(tp: type[T], raw: Any, *, unknown: str = "unknown field") -> tuple[T | None, list[Problem]]:
    """Every problem of ``raw`` and the model made of what is left once the wrong parts are dropped
    (a wrong value falls back to its default; an object still missing a required field is dropped
    from its list or parent), so checks across fields can report in the same pass. None when
    nothing usable is left."""
    raw = drop_nulls(raw)
    found = problems(tp, raw, unknown=unknown)
    if not found:
        return msgspec.convert(raw, tp, strict=True), []
    rest, drop = raw, [_drop_loc(p) for p in found]
    for _ in range(8):
        for loc in sorted(set(drop), key=_loc_key, reverse=True):
            rest = _without(rest, loc)
        again = problems(tp, rest, unknown=unknown)
        if not again:
            return msgspec.convert(rest, tp, strict=True), found
        drop = [_drop_loc(p) for p in again]
        if () in drop:
            break
    return None, found


def problems(tp: Any, raw: Any, *, unknown: str = "unknown field") -> list[Problem]:
    out: list[Problem] = []
    _explain(tp, raw, (), out, unknown)
    return out


def to_builtins(value: Any, *, omit_none: bool = False) -> Any:
    """A model (or part of one) as plain JSON data under its document keys; lists for tuples."""
    return _plain(msgspec.to_builtins(value), omit_none)


def _plain(value: Any, omit_none: bool) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v, omit_none) for k, v in value.items() if not (omit_none and v is None)}
    if isinstance(value, (list, tuple)):
        return [_plain(v, omit_none) for v in value]
    return value


# --- naming each problem -----------------------------------------------------------------


def _drop_loc(problem: Problem) -> Loc:
    """What to drop for ``problem``: the wrong value, or the object a required field is missing from."""
    return problem.loc[:-1] if problem.message == "required" else problem.loc


def _loc_key(loc: Loc) -> tuple:
    return tuple((0, p) if isinstance(p, int) else (1, p) for p in loc)


def _without(doc: Any, loc: Loc) -> Any:
    if not loc:
        return doc
    head, rest = loc[0], loc[1:]
    if isinstance(doc, dict) and head in doc:
        if not rest:
            return {k: v for k, v in doc.items() if k != head}
        return {**doc, head: _without(doc[head], rest)}  # type: ignore[index]
    if isinstance(doc, list) and isinstance(head, int) and head < len(doc):
        if not rest:
            return doc[:head] + doc[head + 1:]
        return [*doc[:head], _without(doc[head], rest), *doc[head + 1:]]
    return doc


def _bare(tp: Any) -> Any:
    """``tp`` without Annotated and Optional."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, _UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


_UnionType = type(int | str)


def _explain(tp: Any, value: Any, loc: Loc, out: list[Problem], unknown: str) -> None:
    try:
        msgspec.convert(value, tp, strict=True)
        return
    except msgspec.ValidationError as e:
        error = str(e)
    before = len(out)
    bare = _bare(tp)
    origin, args = typing.get_origin(bare), typing.get_args(bare)
    if isinstance(bare, type) and issubclass(bare, msgspec.Struct) and isinstance(value, dict):
        fields = {f.encode_name: f for f in msgspec.structs.fields(bare)}
        if bare.__struct_config__.forbid_unknown_fields:
            out += [Problem(loc + (k,), unknown) for k in sorted(set(value) - set(fields))]
        for key, f in fields.items():
            if key in value:
                _explain(f.type, value[key], loc + (key,), out, unknown)
            elif f.required:
                out.append(Problem(loc + (key,), "required"))
    elif origin in (list, tuple) and isinstance(value, list):
        for i, item in enumerate(value):
            _explain(args[0], item, loc + (i,), out, unknown)
    elif origin in (dict, collections.abc.Mapping) and isinstance(value, dict):
        for key, item in value.items():
            _explain(args[1], item, loc + (Key(key),), out, unknown)
    if len(out) == before:  # nothing inside is wrong: the value itself is
        out.append(Problem(loc, _message(tp, value, error)))


def _message(tp: Any, value: Any, error: str) -> str:
    info: Any = mi.type_info(tp)
    extra: dict[str, Any] = {}
    for _ in range(3):  # Annotated[Optional[Annotated[T, Meta]], Meta]: metadata and unions, peeled
        if isinstance(info, mi.Metadata):
            extra, info = {**extra, **(info.extra_json_schema or {})}, info.type
        elif isinstance(info, mi.UnionType):
            members = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(members) == 1:
                info = members[0]
                continue
            kinds = [_KINDS.get(type(t.type if isinstance(t, mi.Metadata) else t)) for t in members]
            if None in kinds:
                return _bare_message(error)
            return f"must be {' or '.join(map(str, kinds))}, got {value!r}"
    text = _describe(info, value) or _bare_message(error)
    if extra.get("examples"):
        text += f", e.g. {extra['examples'][0]}"
    return text


_KINDS = {mi.IntType: "an integer", mi.FloatType: "a number", mi.StrType: "a string", mi.BoolType: "true or false",
          mi.ListType: "a list", mi.DictType: "an object", mi.StructType: "an object"}


def _describe(info: Any, value: Any) -> str | None:
    got = f"got {value!r}"
    if isinstance(info, mi.LiteralType):
        return f"{value!r} is not one of {', '.join(map(str, info.values))}"
    if isinstance(info, mi.BoolType):
        return f"must be true or false, {got}"
    if isinstance(info, (mi.IntType, mi.FloatType)):
        kind = "an integer" if isinstance(info, mi.IntType) else "a number"
        if isinstance(value, bool) or not isinstance(value, int if isinstance(info, mi.IntType) else (int, float)):
            return f"must be {kind}, {got}"
        if info.gt is not None and value <= info.gt:
            return f"{value} must be greater than {info.gt}"
        if info.ge is not None and info.le is not None:
            return f"{value} is out of range; use a value between {info.ge} and {info.le}"
        bounds = [f"{word} {limit}" for word, limit in (("above", info.gt), ("at least", info.ge),
                                                         ("below", info.lt), ("at most", info.le))
                  if limit is not None]
        return f"{value} is out of range; use a value {' and '.join(bounds)}"
    if isinstance(info, mi.StrType):
        if not isinstance(value, str):
            return f"must be a string, {got}"
        if info.min_length is not None and len(value) < info.min_length:
            return "must not be empty" if info.min_length == 1 else f"must be at least {info.min_length} characters"
        if info.max_length is not None and len(value) > info.max_length:
            return f"must be at most {info.max_length} characters, got {len(value)}"
        if info.pattern is not None:
            return f"{value!r} does not match {info.pattern}"
    if isinstance(info, (mi.ListType, mi.VarTupleType)):
        if not isinstance(value, list):
            return f"must be a list, {got}"
        if info.min_length is not None and len(value) < info.min_length:
            return f"must have at least {info.min_length} item{'s' if info.min_length > 1 else ''}"
        if info.max_length is not None and len(value) > info.max_length:
            return f"must have at most {info.max_length} items, got {len(value)}"
    if isinstance(info, (mi.DictType, mi.StructType)):
        if not isinstance(value, dict):
            return f"must be an object, {got}"
        if isinstance(info, mi.DictType) and info.max_length is not None and len(value) > info.max_length:
            return f"must have at most {info.max_length} entries, got {len(value)}"
    return None


def _bare_message(error: str) -> str:
    """msgspec's own wording without its `$.path` suffix (the path is the problem's)."""
    return error.split(" - at `$", 1)[0]
