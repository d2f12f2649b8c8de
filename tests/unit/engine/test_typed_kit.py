"""The typed-model kit (gpufleet_api.typed): msgspec converts, the kit names every
problem by its camelCase path and keeps what is left usable."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import msgspec
import pytest
from msgspec import Meta

from gpufleet_api import typed


class Item(typed.Model, frozen=True, forbid_unknown_fields=True):
    name: str
    max_wait_seconds: Annotated[float, Meta(gt=0)]


class Doc(typed.Model, frozen=True, forbid_unknown_fields=True):
    mode: Literal["Auto", "Manual"] = "Auto"
    max_replicas: Annotated[int, Meta(ge=1, le=10)] = 4
    items: tuple[Item, ...] = ()
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    gib: Optional[Annotated[int, Meta(ge=1)]] = msgspec.field(default=None, name="sizeGiB")


def test_keys_are_camel_case_and_encoding_round_trips():
    doc = Doc(max_replicas=3, items=(Item("a", 1.5),), gib=2)
    data = typed.to_builtins(doc)
    assert data == {"mode": "Auto", "maxReplicas": 3, "items": [{"name": "a", "maxWaitSeconds": 1.5}],
                    "labels": {}, "sizeGiB": 2}
    assert typed.convert(Doc, data) == doc
    assert "sizeGiB" not in typed.to_builtins(Doc(), omit_none=True)


def test_every_problem_is_named_by_its_path_with_the_value_and_the_fix():
    raw = {"mode": "Sometimes", "maxReplicas": 11, "items": [{"name": "a", "maxWaitSeconds": -1}, {"name": 3}],
           "labels": {"zone": 5}, "maxReplica": 2}
    with pytest.raises(typed.Invalid) as e:
        typed.convert(Doc, raw)
    assert [str(p) for p in e.value.problems] == [
        "maxReplica: unknown field",
        "mode: 'Sometimes' is not one of Auto, Manual",
        "maxReplicas: 11 is out of range; use a value between 1 and 10",
        "items[0].maxWaitSeconds: -1 must be greater than 0",
        "items[1].name: must be a string, got 3",
        "items[1].maxWaitSeconds: required",
        "labels['zone']: must be a string, got 5",
    ]


def test_salvage_keeps_what_is_right_for_checks_across_fields():
    value, problems = typed.salvage(Doc, {"maxReplicas": "4", "items": [{"name": "a", "maxWaitSeconds": 1},
                                                                        {"name": "b", "maxWaitSeconds": 0}]})
    assert [p.path for p in problems] == ["maxReplicas", "items[1].maxWaitSeconds"]
    assert value == Doc(items=(Item("a", 1.0),))


def test_null_counts_as_left_out():
    assert typed.convert(Doc, {"maxReplicas": None, "sizeGiB": None}) == Doc()
